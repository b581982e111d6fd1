"""A lean runner's forward replayed from CUDA graphs: one captured graph per row count.

Why: at batch 1 on a GPU, a small model's step is bound by launching kernels, not by the GPU. The
lean forward issues ~33 kernels per layer (about 1,000 per SmolLM2-135M step), each a few
microseconds of launch and Python; an H200 ran the eager loop at about the CPU's speed. A graph
launches the whole forward at once.

A graph has fixed shapes and addresses, so the captured forward (`LeanRunner.forward_at`) differs
from the eager one in three ways (same arithmetic otherwise):
  * it reads its token ids and start position from a static device buffer [M + 1], filled by one
    host-to-device copy (a subset draft's id -> row map is applied inside the graph);
  * it writes keys and values at positions start..start+M-1 by index and attends over the cache's
    whole capacity, masking key j for query row i unless j <= start + i (the cache is zero-filled,
    so the masked keys stay finite);
  * it computes the logits of all M rows into a static output, copied out before the next replay.
Row counts above MAX_GRAPH_ROWS (prompt prefill) run the eager forward on the same cache. Growing
the cache reallocates it, which drops the graphs; the cache starts at MIN_CAPACITY positions so
that evaluation prompts rarely grow it.
"""

from __future__ import annotations

import torch

from decode.runners.lean import LeanRunner

# Blocks verify k + 1 <= 9 tokens (k <= 8) and a draft catches up on a few tokens at a time:
# graphs cover 1..16 rows. Larger feeds are prompt prefill, run once per prompt.
MAX_GRAPH_ROWS = 16
# 2,048 positions of SmolLM2-135M's bf16 cache: 30 layers x 2 x 3 heads x 2048 x 64 x 2 B = 47 MB,
# read by every step's attention (~15 us at the H200's ~3 TB/s).
MIN_CAPACITY = 2048


class _StaticForward:
    """One row count's input buffer [M + 1] (ids, then the start position), its graph, its output."""

    def __init__(self, lean: LeanRunner, m: int, capture: bool):
        self.lean, self.m, self.capture = lean, m, capture
        self.inputs = torch.zeros(m + 1, dtype=torch.long, device=lean.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [M, head rows] fp32, written by each run

    def compute(self) -> torch.Tensor:
        lean, m = self.lean, self.m
        positions = self.inputs[m] + torch.arange(m, device=lean.device)  # [M]
        ids = self.inputs[:m]
        rows = ids if lean.subset is None else lean.subset.rows(ids)  # embedding rows
        return lean.forward_at(rows, positions)

    def run(self) -> torch.Tensor:
        if not self.capture:  # no CUDA: the same static computation, run eagerly (tests, CPU)
            self.logits = self.compute()
        elif self.graph is None:
            # Warm-up on a side stream (kernel selection, cuBLAS workspaces), as CUDA graph capture
            # needs. It writes the same keys and values as this call's replay, so it changes nothing.
            device = self.lean.device
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.compute()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.compute()
            self.graph.replay()
        else:
            self.graph.replay()
        return self.logits


class GraphRunner:
    """Wraps a `LeanRunner`: its 1..MAX_GRAPH_ROWS-token forwards replay CUDA graphs (implements `Runner`).

    capture=False runs the graphs' static computation eagerly, on any device (how the CPU tests
    check it against the eager forward). Hidden states are not kept (the graphs capture logits only)."""

    def __init__(self, lean: LeanRunner, capture: bool = True):
        if capture and lean.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        if lean.hidden_layers:
            raise ValueError("the CUDA-graph runner keeps no hidden states: "
                             "use the 'lean' backend for hidden_layers")
        self.lean, self.capture = lean, capture
        self.vocab_size, self.subset, self.max_length = lean.vocab_size, lean.subset, lean.max_length
        self.device = lean.device
        self.hidden_layers: tuple[int, ...] = ()
        self.hidden_states = None
        self._forwards: dict[int, _StaticForward] = {}
        lean.reserve(min(MIN_CAPACITY, self.max_length))
        self._graph_capacity = lean.capacity  # the cache the graphs were captured on

    @property
    def length(self) -> int:
        return self.lean.length

    @property
    def capacity(self) -> int:
        return self.lean.capacity

    @property
    def captured(self) -> list[int]:
        """Row counts whose forward has been captured as a CUDA graph."""
        return sorted(m for m, static in self._forwards.items() if static.graph is not None)

    def reset(self) -> None:
        self.lean.reset()

    def rollback(self, length: int) -> None:
        self.lean.rollback(length)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        m, start = ids.shape[0], self.lean.length
        if m > MAX_GRAPH_ROWS:
            return self.lean.forward(ids, num_logits, full_vocab)
        assert 1 <= num_logits <= m, (num_logits, m)
        self.lean.reserve(start + m)
        if self.lean.capacity != self._graph_capacity:  # grown here or by an eager forward
            self._forwards.clear()  # the graphs read the old cache's addresses
            self._graph_capacity = self.lean.capacity
        static = self._forwards.get(m)
        if static is None:
            static = self._forwards[m] = _StaticForward(self.lean, m, self.capture)
        host = torch.empty(m + 1, dtype=torch.long)  # token ids, then the start position: one copy
        host[:m] = ids
        host[m] = start
        static.inputs.copy_(host)
        logits = static.run()[-num_logits:].clone()  # the next run overwrites its output
        self.lean.advance(m)
        return self.lean.to_vocab(logits, full_vocab)
