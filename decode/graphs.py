"""The lean runner's forward replayed from CUDA graphs: one captured graph per row count.

Why: at batch 1 on a GPU, a small model's step is bound by launching kernels, not by the GPU. The
lean forward issues ~33 kernels per layer (about 1,000 per SmolLM2-135M step), each a few
microseconds of launch and Python; an H200 ran the eager loop at about the CPU's speed. A graph
launches the whole forward at once.

A graph has fixed shapes and addresses, so the captured forward differs from the eager one in
three ways (same arithmetic otherwise):
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

from decode.lean import LeanLlamaRunner

# Blocks verify k + 1 <= 9 tokens (k <= 8) and a draft catches up on a few tokens at a time:
# graphs cover 1..16 rows. Larger feeds are prompt prefill, run once per prompt.
MAX_GRAPH_ROWS = 16
# 2,048 positions of SmolLM2-135M's bf16 cache: 30 layers x 2 x 3 heads x 2048 x 64 x 2 B = 47 MB,
# read by every step's attention (~15 us at the H200's ~3 TB/s).
MIN_CAPACITY = 2048


class _StaticForward:
    """One row count's input buffer [M + 1] (ids, then the start position), its graph, its output."""

    def __init__(self, runner: GraphLeanRunner, m: int, capture: bool):
        self.runner, self.m, self.capture = runner, m, capture
        self.inputs = torch.zeros(m + 1, dtype=torch.long, device=runner.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [M, n_out] fp32, written by each run

    def compute(self) -> torch.Tensor:
        r, m = self.runner, self.m
        positions = self.inputs[m] + torch.arange(m, device=r.device)  # [M]
        keys = torch.arange(r.capacity, device=r.device)  # [capacity]
        mask = (keys[None, :] <= positions[:, None]).repeat(r.n_heads // r.n_kv, 1)  # [group M, capacity]
        ids = self.inputs[:m] if r.input_map is None else r.input_map[self.inputs[:m]]  # embedding rows
        return r._head(r._hidden(ids, positions, r.capacity, mask))

    def run(self) -> torch.Tensor:
        if not self.capture:  # no CUDA: the same static computation, run eagerly (tests, CPU)
            self.logits = self.compute()
        elif self.graph is None:
            # Warm-up on a side stream (kernel selection, cuBLAS workspaces), as CUDA graph capture
            # needs. It writes the same keys and values as this call's replay, so it changes nothing.
            side = torch.cuda.Stream(self.runner.device)
            side.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(side):
                self.compute()
            torch.cuda.current_stream(self.runner.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.compute()
            self.graph.replay()
        else:
            self.graph.replay()
        return self.logits


class GraphLeanRunner(LeanLlamaRunner):
    """`LeanLlamaRunner` whose 1..MAX_GRAPH_ROWS-token forwards replay CUDA graphs.

    capture=False runs the graphs' static computation eagerly, on any device (how the CPU tests
    check it against the eager forward).
    """

    def __init__(self, model, vocab_size: int, capture: bool = True):
        if capture and next(model.parameters()).device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self.capture = capture
        self._forwards: dict[int, _StaticForward] = {}
        super().__init__(model, vocab_size)
        self._reserve(min(MIN_CAPACITY, self.max_length))

    def _reserve(self, needed: int) -> None:
        capacity = self.capacity
        super()._reserve(needed)
        if self.capacity != capacity:
            self._forwards.clear()  # the graphs read the old cache's addresses

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        m, start = ids.shape[0], self.length
        if m > MAX_GRAPH_ROWS:
            return super().forward(ids, num_logits, full_vocab)
        assert 1 <= num_logits <= m, (num_logits, m)
        self._reserve(start + m)
        static = self._forwards.get(m)
        if static is None:
            static = self._forwards[m] = _StaticForward(self, m, self.capture)
        host = torch.empty(m + 1, dtype=torch.long)  # token ids, then the start position: one copy
        host[:m] = ids
        host[m] = start
        static.inputs.copy_(host)
        logits = static.run()[-num_logits:].clone()  # the next run overwrites its output
        self.length = start + m
        return self._to_vocab(logits, full_vocab)

