"""The model layer's interfaces: what the decode loops and the generation engine may ask of a model.

Two cache layouts, one forward per model family behind them:

  Runner         batch 1, a KV cache rolled back by length (speculative and target-only decoding)
  BatchedRunner  many rows, left-padded, finished rows dropped (bulk generation and scoring)

Implementations: the lean Llama core (decode/runners/llama.py) behind both layouts, the Hugging Face
forward for any other causal LM (decode/runners/hf.py), and CUDA-graph replay wrapping a lean
runner (decode/runners/graphs.py). `decode.runners.make_runner` / `make_batched_runner` pick one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from decode.vocab import VocabSubset


class Runner(Protocol):
    """Batch-1 forward over a rollback cache.

    The invariant the decode loops keep: runner.length == committed tokens - 1 (the last committed
    token is fed on the next call)."""

    vocab_size: int
    """The full vocabulary the runner speaks (logits with full_vocab=True have this many columns)."""
    subset: VocabSubset | None
    """A vocabulary-subset draft's rows <-> ids; None when rows are token ids."""
    length: int
    """Positions in the cache."""
    max_length: int
    """The model's context: positions beyond it raise."""
    device: torch.device
    """Where the model's weights and cache live."""
    hidden_layers: tuple[int, ...]
    """Decoder layers whose output hidden states each forward keeps (empty: none)."""
    hidden_states: torch.Tensor | None
    """[n, len(hidden_layers), hidden] for the n ids of the last forward (None without hidden_layers)."""

    def reset(self) -> None:
        """Forget every cached position."""

    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        """Feed ids [n] at positions length..length+n-1; return fp32 logits [num_logits, vocab_size] of the
        last num_logits positions (full_vocab=False: [num_logits, N] over a subset draft's N rows)."""

    def rollback(self, length: int) -> None:
        """Forget every cached position from `length` on."""


class BatchedRunner(Protocol):
    """Many rows at once: prefill(rows) -> last-position logits; step(tokens) -> next logits."""

    def prefill(self, prompts: list[list[int]], capacity: int, all_hidden: bool = False) -> torch.Tensor:
        """Start a batch: left-pad the prompts into a fresh cache of `capacity` slots per row. Returns fp32
        logits [B, V] of each prompt's last token, or with all_hidden the final (normed) hidden states
        [B, L, H] of every slot, pads included, for teacher-forced scoring."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row [B] at the next slot -> fp32 logits [B, V]."""

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only cache rows `rows`, in that order (finished rows stop costing compute); a row listed
        twice is copied (the samples of one prompt share its prefill)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., H] -> fp32 logits [..., V]."""
