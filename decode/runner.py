"""A causal LM behind a KV cache that can be rolled back by length.

Both decode loops talk to models only through `ModelRunner`:
  forward(ids, num_logits) -> fp32 logits [num_logits, vocab_size] for the last positions
                              (full_vocab=False: [num_logits, N] over a subset draft's N rows,
                              `subset_ids` giving each row's token id; the speculative loop
                              samples the draft there and skips a vocabulary-wide scatter per token)
  rollback(length)         -> forget every cached token from position `length` on
The invariant the loops keep: runner.length == committed tokens - 1 (the last committed
token is fed on the next call).

Draft vocabulary subsets: a draft whose config carries `draft_vocab_ids` (N ids of the
full vocabulary) has an embedding/head of N + 1 rows; input ids outside the subset map
to row N ("other"), and its output logits are scattered back to the full vocabulary with
-inf elsewhere, so the draft gives probability 0 outside the subset and the acceptance
rule stays exact.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def subset_maps(config, vocab_size: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(subset_ids [N], input_map [vocab_size]) for a vocabulary-subset draft, else (None, None).
    input_map sends a full-vocabulary id to its row in the draft's embedding, ids outside the
    subset to the "other" row N."""
    subset = getattr(config, "draft_vocab_ids", None)
    if not subset:
        return None, None
    subset_ids = torch.tensor(subset, dtype=torch.long, device=device)
    input_map = torch.full((vocab_size,), len(subset), dtype=torch.long, device=device)
    input_map[subset_ids] = torch.arange(len(subset), device=device)
    return subset_ids, input_map


class ModelRunner:
    """Hugging Face forward with a DynamicCache (any causal LM)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.subset_ids, self.input_map = subset_maps(model.config, vocab_size, self.device)
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 10**9
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.length = 0

    def rollback(self, length: int) -> None:
        """Drop cached positions >= length (transformers 5: crop takes a negative count)."""
        assert 0 <= length <= self.length, (length, self.length)
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        """Feed ids [n] at positions length..length+n-1; return logits [num_logits, vocab_size]
        (full_vocab=False: [num_logits, N] over a subset draft's rows)."""
        ids = ids.to(self.device)
        model_ids = self.input_map[ids] if self.input_map is not None else ids
        out = self.model(input_ids=model_ids[None], cache=self.cache, use_cache=True,
                         logits_to_keep=num_logits)
        self.length += ids.shape[0]
        logits = out.logits[0, -num_logits:].float()
        if not full_vocab and self.subset_ids is not None:
            return logits[:, : self.subset_ids.shape[0]]  # the "other" row is never emitted
        return self._to_full_vocab(logits)

    def _to_full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.subset_ids is None:
            # Padded embedding rows beyond the shared vocabulary are sliced away.
            return logits[:, : self.vocab_size]
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.subset_ids] = logits[:, : self.subset_ids.shape[0]]
        return full


def model_vocab_size(model: torch.nn.Module) -> int:
    """Size of the full vocabulary a model speaks (a subset draft speaks the full one through its map)."""
    subset = getattr(model.config, "draft_vocab_ids", None)
    if subset:
        return int(getattr(model.config, "full_vocab_size"))
    return int(model.get_output_embeddings().weight.shape[0])


def make_runner(model: torch.nn.Module, vocab_size: int, backend: str = "auto") -> ModelRunner:
    """Pick the runner for a model: 'lean' (the lean Llama forward), 'graph' (the lean forward replayed
    from CUDA graphs; CUDA only), 'hf' (the Hugging Face forward), or 'auto': 'graph' on CUDA and
    'lean' elsewhere where the lean runner supports the model, else 'hf'."""
    if backend not in ("auto", "lean", "graph", "hf"):
        raise ValueError(f"unknown backend {backend!r}; use 'auto', 'lean', 'graph' or 'hf'")
    if backend == "hf":
        return ModelRunner(model, vocab_size)
    from decode.graphs import GraphLeanRunner
    from decode.lean import LeanLlamaRunner, lean_supported

    if not lean_supported(model):
        if backend != "auto":
            raise ValueError(f"the {backend} runner does not support {type(model).__name__}")
        return ModelRunner(model, vocab_size)
    on_cuda = next(model.parameters()).device.type == "cuda"
    if backend == "graph" or (backend == "auto" and on_cuda):
        return GraphLeanRunner(model, vocab_size)
    return LeanLlamaRunner(model, vocab_size)
