"""The model layer: every forward the decode loops and the generation engine run (see protocol.py).

    runner = make_runner(model, vocab_size)            # batch 1, rollback cache: Runner
    batched = make_batched_runner(target)              # many rows, left-padded: BatchedRunner
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode.runners.batched import LeanBatchedRunner
from decode.runners.graphs import GraphRunner
from decode.runners.hf import HFBatchedRunner, HFRunner
from decode.runners.lean import LeanRunner
from decode.runners.llama import lean_supported
from decode.runners.protocol import BatchedRunner, Runner
from decode.vocab import VocabSubset


__all__ = ["BatchedRunner", "Runner", "make_batched_runner", "make_runner"]


def make_runner(model: torch.nn.Module, vocab_size: int, backend: str = "auto",
                hidden_layers: Sequence[int] = ()) -> Runner:
    """Pick the batch-1 runner for a model: 'lean' (the lean Llama forward), 'graph' (the lean forward
    replayed from CUDA graphs; CUDA only), 'hf' (the Hugging Face forward), or 'auto': 'graph' on CUDA
    and 'lean' elsewhere where the lean forward supports the model, else 'hf'. hidden_layers: decoder
    layers whose outputs each forward keeps in `runner.hidden_states`."""
    if backend not in ("auto", "lean", "graph", "hf"):
        raise ValueError(f"unknown backend {backend!r}; use 'auto', 'lean', 'graph' or 'hf'")
    if backend == "hf":
        return HFRunner(model, vocab_size, hidden_layers)
    if not lean_supported(model):
        if backend != "auto":
            raise ValueError(f"the {backend} runner does not support {type(model).__name__}")
        return HFRunner(model, vocab_size, hidden_layers)
    on_cuda = next(model.parameters()).device.type == "cuda"
    lean = LeanRunner(model, vocab_size, hidden_layers)
    if backend == "graph" or (backend == "auto" and on_cuda):
        return GraphRunner(lean)
    return lean


def make_batched_runner(model: torch.nn.Module, backend: str = "auto", matmul_dtype: torch.dtype | None = None,
                        hidden_layers: Sequence[int] = ()) -> BatchedRunner:
    """The batched runner for a target: 'lean' (the lean Llama forward; refuses other models), 'hf' (the
    Hugging Face forward), or 'auto': lean where supported, else hf.

    matmul_dtype (e.g. torch.bfloat16): the lean runner keeps the model's weights and residual stream
    and runs only its GEMMs in this dtype; the HF runner casts the whole model to it. hidden_layers: decoder
    layers whose outputs every forward keeps in `runner.hidden_states` (the lean runner only)."""
    if backend not in ("auto", "lean", "hf"):
        raise ValueError(f"unknown backend {backend!r}; use 'auto', 'lean' or 'hf'")
    if VocabSubset.of(model) is not None:
        raise ValueError("batched runners serve targets; this is a vocabulary-subset draft")
    if hidden_layers and (backend == "hf" or not lean_supported(model)):
        raise ValueError(f"only the lean batched runner keeps hidden states (backend 'lean' or 'auto', a model it "
                         f"supports; this is backend {backend!r} and a {type(model).__name__})")
    if backend == "hf" or (backend == "auto" and not lean_supported(model)):
        return HFBatchedRunner(model if matmul_dtype is None else model.to(matmul_dtype))
    if not lean_supported(model):
        raise ValueError(f"the lean batched runner does not support {type(model).__name__}")
    return LeanBatchedRunner(model, matmul_dtype, tuple(hidden_layers))
