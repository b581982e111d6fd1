"""A lean runner's forwards replayed from CUDA graphs: one captured graph per row count and kind.

Why: at batch 1 on a GPU, a small model's step is bound by launching kernels, not by the GPU. The
lean forward issues ~33 kernels per layer (about 1,000 per SmolLM2-135M step), each a few
microseconds of launch and Python; an H200 ran the eager loop at about the CPU's speed. A graph
launches the whole forward at once.

A graph has fixed shapes and addresses, so the captured forward (`LeanRunner.forward_at`) differs
from the eager one in three ways (same arithmetic otherwise):
  * it reads its inputs from one static device buffer, filled by one host-to-device copy: the token
    ids and the first slot, and for a draft tree (`forward_masked`) the rotary positions and which
    slots of a window of TREE_WINDOW from the first slot not every row sees each row sees (a subset
    draft's id -> row map is applied inside the graph);
  * it writes keys and values at slots start..start+M-1 by index and attends over the cache's whole
    capacity, masking every key a row does not see (the cache is zero-filled, so masked keys stay finite);
  * it computes the logits of all M rows (and the hidden states a feature draft reads) into static
    outputs, copied out before the next replay.
Causal forwards of up to MAX_GRAPH_ROWS rows and tree forwards of up to MAX_TREE_ROWS replay graphs;
larger ones (prompt prefill) run the eager forward on the same cache. Growing the cache reallocates
it, which drops the graphs; the cache starts at MIN_CAPACITY positions so that evaluation prompts
rarely grow it.
"""

from __future__ import annotations

import torch

from decode.runners.lean import LeanRunner


# Blocks verify k + 1 <= 9 tokens (k <= 8) and a draft catches up on a few tokens at a time:
# causal graphs cover 1..16 rows. Larger feeds are prompt prefill, run once per prompt.
MAX_GRAPH_ROWS = 16
# A tree forward feeds the committed token not yet cached and the tree's nodes: up to 64 nodes, the
# largest tree the cost model prices (decode/timing.py).
MAX_TREE_ROWS = 65
# A tree forward's rows see every cached slot before some slot `base` (the committed text) and a pattern
# of slots from there on (their ancestors: earlier levels of a draft's tree, then the forward's own rows):
# a graph takes patterns up to this many slots wide. A target's verification spans at most MAX_TREE_ROWS,
# a draft's level its tree so far (a dynamic tree of depth 8 and branch 4: 32 slots).
TREE_WINDOW = 128
# 2,048 positions of SmolLM2-135M's bf16 cache: 30 layers x 2 x 3 heads x 2048 x 64 x 2 B = 47 MB,
# read by every step's attention (~15 us at the H200's ~3 TB/s).
MIN_CAPACITY = 2048


class _StaticForward:
    """One row count's input buffer, its graph and its outputs. The buffer holds the ids [M] and the
    first slot; a tree forward's also `base`, its rotary positions [M] and the slots base.. each row
    sees [M x TREE_WINDOW]."""

    def __init__(self, lean: LeanRunner, m: int, tree: bool, capture: bool):
        self.lean, self.m, self.tree, self.capture = lean, m, tree, capture
        size = m + 1 + (1 + m + m * TREE_WINDOW if tree else 0)
        self.inputs = torch.zeros(size, dtype=torch.long, device=lean.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [M, head rows] fp32, written by each run
        self.hidden: torch.Tensor | None = None  # [M, len(hidden_layers), hidden] where the runner keeps them

    def compute(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        lean, m, inputs = self.lean, self.m, self.inputs
        ids, start = inputs[:m], inputs[m]
        slots = start + torch.arange(m, device=lean.device)  # [M]
        keys = torch.arange(lean.capacity, device=lean.device)  # [capacity]
        if self.tree:
            base, positions = inputs[m + 1], inputs[m + 2 : 2 * m + 2]
            sees = inputs[2 * m + 2 :].view(m, TREE_WINDOW).bool()  # row i sees slot base + j
            offset = keys - base
            windowed = (offset >= 0) & (offset < TREE_WINDOW)
            visible = (keys < base)[None, :] | (windowed[None, :] & sees[:, offset.clamp(0, TREE_WINDOW - 1)])
        else:
            positions = slots
            visible = keys[None, :] <= slots[:, None]
        rows = ids if lean.subset is None else lean.subset.rows(ids)  # embedding rows
        return lean.forward_at(rows, positions, slots, visible), lean.hidden_states

    def run(self) -> None:
        if not self.capture:  # no CUDA: the same static computation, run eagerly (tests, CPU)
            self.logits, self.hidden = self.compute()
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
                self.logits, self.hidden = self.compute()
            self.graph.replay()
        else:
            self.graph.replay()


class GraphRunner:
    """Wraps a `LeanRunner`: its forwards of up to MAX_GRAPH_ROWS tokens (MAX_TREE_ROWS for a tree)
    replay CUDA graphs (implements `Runner`, and the masked forward and `keep` of tree verification).

    capture=False runs the graphs' static computation eagerly, on any device (how the CPU tests
    check it against the eager forward)."""

    def __init__(self, lean: LeanRunner, capture: bool = True):
        if capture and lean.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self.lean, self.capture = lean, capture
        self.vocab_size, self.subset, self.max_length = lean.vocab_size, lean.subset, lean.max_length
        self.device = lean.device
        self.hidden_layers = lean.hidden_layers
        self._forwards: dict[tuple[int, bool], _StaticForward] = {}
        lean.reserve(min(MIN_CAPACITY, self.max_length))
        self._graph_capacity = lean.capacity  # the cache the graphs were captured on

    @property
    def length(self) -> int:
        return self.lean.length

    @property
    def capacity(self) -> int:
        return self.lean.capacity

    @property
    def hidden_states(self) -> torch.Tensor | None:
        return self.lean.hidden_states

    @property
    def static_shapes(self) -> list[tuple[int, bool]]:
        """(row count, tree) of every forward run from static buffers (captured as a graph with capture)."""
        return sorted(self._forwards)

    def reset(self) -> None:
        self.lean.reset()

    @torch.inference_mode()
    def capture_ahead(self, row_counts: range, tree: bool = False) -> None:
        """Capture the forwards of these row counts now (causal, or tree forwards), so that no later call
        spends a capture (tens of milliseconds for a 30-layer target) inside a timed run. Needs an empty
        cache: the captures write keys and values (finite: row i sees rows 0..i) into its first slots,
        which every later forward overwrites before any row reads them."""
        if self.lean.length:
            raise ValueError("capture graphs on an empty runner (reset it first)")
        most = MAX_TREE_ROWS if tree else MAX_GRAPH_ROWS
        for m in row_counts:
            if not 1 <= m <= most:
                raise ValueError(f"{'tree' if tree else 'causal'} graphs take 1..{most} rows, not {m}")
            ids = torch.zeros(m, dtype=torch.long)
            sees = torch.zeros(m, TREE_WINDOW, dtype=torch.long)
            sees[:, :m] = torch.ones(m, m, dtype=torch.long).tril()
            self._replay(ids, (0, torch.arange(m), sees) if tree else None, 1, False)
            self.lean.reset()

    def rollback(self, length: int) -> None:
        self.lean.rollback(length)

    def keep(self, length: int, slots: list[int]) -> None:
        self.lean.keep(length, slots)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        m = ids.shape[0]
        if m > MAX_GRAPH_ROWS:
            return self.lean.forward(ids, num_logits, full_vocab)
        return self._replay(ids.cpu(), None, num_logits, full_vocab)

    @torch.inference_mode()
    def forward_masked(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                       num_logits: int, full_vocab: bool = True) -> torch.Tensor:
        """As `LeanRunner.forward_masked` (a draft tree's forward), from a graph where the forward has at most
        MAX_TREE_ROWS rows and its rows' visible slots differ within TREE_WINDOW slots (else eagerly)."""
        m, end = ids.shape[0], self.lean.length + ids.shape[0]
        visible = visible.cpu()
        base = int(visible.all(0).long().cumprod(0).sum())  # every row sees the slots before base
        if m > MAX_TREE_ROWS or end - base > TREE_WINDOW:
            return self.lean.forward_masked(ids, positions, visible, num_logits, full_vocab)
        sees = torch.zeros(m, TREE_WINDOW, dtype=torch.long)
        sees[:, : end - base] = visible[:, base:]
        return self._replay(ids.cpu(), (base, positions.cpu(), sees), num_logits, full_vocab)

    def _replay(self, ids: torch.Tensor, tree: tuple[int, torch.Tensor, torch.Tensor] | None, num_logits: int,
                full_vocab: bool) -> torch.Tensor:
        """Fill the row count's buffer (one copy), replay its graph (captured on first use), take its outputs.
        tree: (base, rotary positions, slots seen from base) of a tree forward."""
        m, start = ids.shape[0], self.lean.length
        assert 1 <= num_logits <= m, (num_logits, m)
        self.lean.reserve(start + m)
        if self.lean.capacity != self._graph_capacity:  # grown here or by an eager forward
            self._forwards.clear()  # the graphs read the old cache's addresses
            self._graph_capacity = self.lean.capacity
        key = (m, tree is not None)
        static = self._forwards.get(key)
        if static is None:
            static = self._forwards[key] = _StaticForward(self.lean, m, tree is not None, self.capture)
        host = [ids.long(), torch.tensor([start])]
        if tree is not None:
            base, positions, sees = tree
            host += [torch.tensor([base]), positions.long(), sees.reshape(-1)]
        static.inputs.copy_(torch.cat(host))
        static.run()
        logits = static.logits[-num_logits:].clone()  # the next run overwrites its outputs
        self.lean.hidden_states = None if static.hidden is None else static.hidden.clone()
        self.lean.forward_start = start
        self.lean.advance(m)
        return self.lean.to_vocab(logits, full_vocab)
