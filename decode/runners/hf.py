"""Any Hugging Face causal LM behind the two runner interfaces, through its own forward and DynamicCache.

Used for models the lean Llama forward does not cover (backend 'auto') or when forced (backend
'hf'); also the reference the lean runners are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from decode.vocab import VocabSubset


class HFRunner:
    """Batch 1 over a DynamicCache (implements `decode.runners.Runner`).

    A vocabulary-subset draft is fed its subset rows and its logits are put back over the full
    vocabulary by VocabSubset.full_logits (-inf outside the subset, or a spread draft's "other" logit)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, hidden_layers: Sequence[int] = ()):
        self.model = model
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.subset = VocabSubset.of(model)
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 10**9
        self.hidden_layers = tuple(hidden_layers)
        n_layers = model.config.num_hidden_layers
        if any(not 0 <= i < n_layers for i in self.hidden_layers):
            raise ValueError(f"hidden_layers {self.hidden_layers} outside the model's {n_layers} layers")
        self.hidden_states: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.length = self.forward_start = 0

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
        return self._run(ids, num_logits, full_vocab)

    @torch.inference_mode()
    def forward_masked(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                       num_logits: int, full_vocab: bool = True) -> torch.Tensor:
        """As LeanRunner.forward_masked: ids [m] at rotary `positions` [m], row i attending the cached and
        new positions where visible [m, length + m] is True (passed to the model as a 4D mask)."""
        m = ids.shape[0]
        assert visible.shape == (m, self.length + m), (tuple(visible.shape), m, self.length)
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~visible.to(self.device), torch.finfo(dtype).min)  # additive: 0 = attend
        return self._run(ids, num_logits, full_vocab, mask[None, None], positions[None].to(self.device))

    @torch.inference_mode()
    def keep(self, length: int, slots: list[int]) -> None:
        """As LeanRunner.keep: positions before `length`, then the cached `slots` moved right after them."""
        assert self.forward_start <= length <= self.length and all(length <= s < self.length for s in slots)
        index = torch.tensor(list(range(length)) + list(slots), device=self.device)
        for layer in self.cache.layers:  # keys and values [1, KV, length, D]
            layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]
        if self.hidden_states is not None:
            rows = list(range(length - self.forward_start)) + [s - self.forward_start for s in slots]
            self.hidden_states = self.hidden_states[rows]
        self.length = length + len(slots)

    def _run(self, ids: torch.Tensor, num_logits: int, full_vocab: bool, mask: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> torch.Tensor:
        ids = ids.to(self.device)
        rows = ids if self.subset is None else self.subset.rows(ids)
        out = self.model(input_ids=rows[None], cache=self.cache, use_cache=True, logits_to_keep=num_logits,
                         output_hidden_states=bool(self.hidden_layers), attention_mask=mask, position_ids=positions)
        self.forward_start = self.length
        self.length += ids.shape[0]
        if self.hidden_layers:
            # hidden_states[0] is the embedding output, [i + 1] layer i's (the last one after the final norm).
            self.hidden_states = torch.stack([out.hidden_states[i + 1][0] for i in self.hidden_layers], dim=1)
        logits = out.logits[0, -num_logits:].float()
        if self.subset is None:
            return logits[:, : self.vocab_size]  # padded embedding rows beyond the shared vocabulary
        if not full_vocab:
            return logits[:, : self.subset.size]  # the N token rows
        return self.subset.full_logits(logits)


class HFBatchedRunner:
    """The batched interface (`decode.runners.BatchedRunner`) through the HF forward: left-padded rows
    with an attention mask and explicit positions."""

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], capacity: int, all_hidden: bool = False) -> torch.Tensor:
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, L, dtype=torch.long, device=self.device)
        self.mask = torch.zeros(B, L, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
            self.mask[b, L - len(p):] = 1
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        if all_hidden:
            out = self.model.base_model(input_ids=ids, attention_mask=self.mask, position_ids=positions)
            return out.last_hidden_state
        self.cache = DynamicCache()
        out = self.model.base_model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                                    cache=self.cache, use_cache=True)
        # The head over a contiguous copy of the last rows: on a strided [B, 1, H] slice (what logits_to_keep=1
        # gives it) torch 2.13's CPU bf16 linear took 1.6 s for 24 rows of SmolLM2, against 4 ms contiguous.
        return self.logits(out.last_hidden_state[:, -1].contiguous())

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden).float()

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = self.mask.sum(-1, keepdim=True)  # [B, 1]: real tokens so far
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=positions,
                         cache=self.cache, use_cache=True)
        return out.logits[:, -1].float()

    def keep(self, rows: torch.Tensor) -> None:
        self.mask = self.mask[rows]
        self.cache.batch_select_indices(rows)
