"""The matmul of one weight matrix, laid out for the rows each cache layout feeds it.

Both are called as projection(x) = x @ w.T (+ bias) on x [..., in]:
  Projection      batch 1: a handful of rows per forward, where the layout decides the speed (in bf16,
                  one layout for every row count, so a row's bits do not depend on its neighbours)
  CastProjection  batched: many rows, optionally in bf16 (GEMM throughput), on the faster of F.linear
                  and oneDNN's packed weights
"""

from __future__ import annotations

import bisect
import statistics
import time

import torch
import torch.nn.functional as F


# Row counts (M) and layouts, measured on a 2-core AMD EPYC (Zen 4), fp32, 1 thread, ms for the
# matmuls of one SmolLM2-135M forward (30 layers + output head, weights streamed from memory):
#                         M = 1    2    3    5    9   12
#   torch.mm(w, x.T) (MKL)   30   31   50   61  111  146
#   oneDNN, packed weights   38   49   32   30   41   46
# On a 2-core Sapphire Rapids class Xeon (AVX-512 BF16 + AMX, 2 threads) the same layouts rank
# otherwise: per call of the 960x576 qkv weight, F.linear 33/23/26/106 us at M = 1/2/3/5, w @ x.T
# 131/127/126/134, packed 76/78/84/85; the 49152x576 head 3.7 ms with F.linear at M = 1 against 15.0
# with w @ x.T, and packed fastest from M = 3. The AMD's rule cost that Xeon a 92 ms target step
# instead of 46. No one rule holds on every CPU, so `tune_layouts` times them once per process and
# weight shape, when a runner is built, at each of TIMED_ROWS, over every weight of that shape in turn
# (as a forward streams them from memory: one weight timed alone stays in cache and ranks the layouts
# otherwise), and a forward of M rows takes the layout timed fastest at the first timed count >= M
# (the last one beyond it).
LAYOUTS = ("linear", "mm", "packed")
"""F.linear; torch.mm(w, x.T) with one row duplicated into two; oneDNN on weights packed once."""
TIMED_ROWS = (1, 3, 5, 9)
SAMPLES = 5
"""Each layout's time is the median of this many passes over the shape's weights."""
_measured: dict[tuple, tuple[str, ...]] = {}


def _packed_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can run `dtype` weights packed: fp32 wherever oneDNN is built in, bf16 where it also
    computes bf16 natively (avx512_bf16 or AMX; elsewhere it would emulate it)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_tunable(w: torch.Tensor) -> bool:
    """Whether a weight has a choice of layouts: on a CPU in fp32 or bf16."""
    return w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)


# A bf16 batch-1 projection multiplies at most this many rows at once. On a 2-core AMX Xeon (torch
# 2.13, SmolLM2-135M's weights) oneDNN gave each row the bits it gives that row alone up to 32 rows, and
# other bits to a few rows from 33 on (it blocks the rows otherwise there). `rows_match_alone` checks it.
ROW_BLOCK = 32


def rows_match_alone(projections: list[Projection], rows: int, seed: int = 0) -> bool:
    """Whether each weight shape among `projections` gives `rows` random rows multiplied together the bits
    it gives each row alone (one projection per shape, a few ms in all)."""
    gen = torch.Generator().manual_seed(seed)
    by_shape = {tuple(p.w.shape): p for p in projections}
    for projection in by_shape.values():
        x = torch.randn(rows, projection.w.shape[1], generator=gen).to(projection.w.dtype)
        together = projection.run(projection.layouts[-1], x)
        if not torch.equal(together, torch.cat([projection.run(projection.layouts[0], row) for row in x.split(1)])):
            return False
    return True


def row_invariant_layouts(w: torch.Tensor) -> tuple[str, ...] | None:
    """The layouts of a batch-1 CPU bf16 weight: oneDNN's packed weights at every row count where the CPU
    computes bf16 natively, else F.linear; None for other weights (timed per row count instead).

    Why one layout: up to ROW_BLOCK rows each of them gives a row the same result whatever rows share
    its matmul, and a switch of layout between 1 and 5 rows would not. In fp32 that changes logits by ~1e-5; in bf16,
    whose outputs round to 8 bits, one rounding that falls the other way grows layer by layer (0.5 in
    the logits of SmolLM2-135M) and changes greedy tokens. On a 2-core AMX Xeon the packed bf16 weights
    were also the fastest layout at every row count: one forward's matmuls 7.7 ms at 1 row against
    fp32's best 14.1, and 11.5 against 44.1 at 33 rows."""
    if not (w.device.type == "cpu" and w.dtype == torch.bfloat16):
        return None
    return ("packed" if _packed_available(torch.bfloat16) else "linear",) * len(TIMED_ROWS)


def _seconds_per_pass(group: list, layout: str, x: torch.Tensor) -> float:
    """Median seconds of one call per projection of `group` through `layout`, after a warm-up pass."""
    samples = []
    for i in range(SAMPLES + 1):
        start = time.perf_counter()
        for projection in group:
            projection.run(layout, x)
        if i:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def tune_layouts(projections: list[Projection]) -> None:
    """Give each projection without given layouts its shape's fastest layout per TIMED_ROWS, timed here
    over all projections of that shape (once per process, shape and thread count); unused packed copies
    are dropped. About 2 s for SmolLM2-135M on 2 cores."""
    def fastest(group: list[Projection]) -> tuple[str, ...]:
        gen = torch.Generator().manual_seed(0)
        candidates = [name for name in LAYOUTS if name != "packed" or group[0].packed is not None]
        chosen = []
        for m in TIMED_ROWS:
            x = torch.randn(m, group[0].w.shape[1], generator=gen, dtype=group[0].w.dtype)
            chosen.append(min(candidates, key=lambda name: _seconds_per_pass(group, name, x)))
        return tuple(chosen)

    _tune_per_shape([p for p in projections if p.tunable], fastest, Projection.set_layouts)


def _tune_per_shape(projections: list, fastest, apply) -> None:
    """Group projections by `key` (shape, dtype, bias, threads); `fastest(group)` is measured once per key and
    process (`_measured`), and `apply(projection, choice)` gives it to every projection of the group."""
    groups: dict[tuple, list] = {}
    for projection in projections:
        groups.setdefault(projection.key, []).append(projection)
    for key, group in groups.items():
        if key not in _measured:
            _measured[key] = fastest(group)
        for projection in group:
            apply(projection, _measured[key])


class Projection:
    """One weight w [out, in] (and bias [out]) in the layout each row count runs fastest in.

    Only a CPU weight in fp32 or bf16 has a choice of layouts (`cpu_tunable`): given (one per TIMED_ROWS),
    one for every row count in bf16 (`row_invariant_layouts`), or measured by `tune_layouts` (until then
    F.linear); elsewhere this is F.linear. Every layout computes in the weight's dtype. A packed copy
    (this weight's memory again) is kept only where a packed layout is used."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, layouts: tuple[str, ...] | None = None):
        self.w, self.bias = w, bias
        self.key = (tuple(w.shape), w.dtype, bias is not None, torch.get_num_threads())
        # bf16: the most rows multiplied together (more go through further matmuls of as many).
        self.row_block = ROW_BLOCK if row_invariant_layouts(w) else None
        tunable = cpu_tunable(w)
        layouts = ("linear",) * len(TIMED_ROWS) if not tunable else (
            layouts or row_invariant_layouts(w) or _measured.get(self.key))
        want_packed = tunable and _packed_available(w.dtype) and (layouts is None or "packed" in layouts)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 8) if want_packed else None
        if layouts is None:  # F.linear until tune_layouts measures this shape
            self.layouts, self.tunable = ("linear",) * len(TIMED_ROWS), True
        else:
            self.set_layouts(layouts)

    def set_layouts(self, layouts: tuple[str, ...]) -> None:
        """Use `layouts` (one of LAYOUTS per TIMED_ROWS) from now on."""
        if len(layouts) != len(TIMED_ROWS) or not set(layouts) <= set(LAYOUTS):
            raise ValueError(f"layouts {layouts}: one of {LAYOUTS} for each of TIMED_ROWS {TIMED_ROWS}")
        if "packed" in layouts and self.packed is None:
            raise ValueError("the packed layout needs oneDNN (torch.backends.mkldnn) and a CPU weight in fp32, or "
                             "in bf16 where the CPU computes bf16 natively")
        self.layouts, self.tunable = tuple(layouts), False
        if "packed" not in layouts:
            self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> contiguous [..., out] (the rows of every leading dimension together: M)."""
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if self.row_block and x.shape[0] > self.row_block:
            return torch.cat([self(rows) for rows in x.split(self.row_block)])
        return self.run(self.layouts[min(bisect.bisect_left(TIMED_ROWS, x.shape[0]), len(TIMED_ROWS) - 1)], x)

    def run(self, layout: str, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> contiguous [M, out] through one layout."""
        if layout == "packed":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if layout == "linear":
            return F.linear(x, self.w, self.bias)
        m = x.shape[0]
        x = x.contiguous()
        if m == 1:
            x = torch.cat([x, x])  # [2, in]: MKL's gemm, not its slower gemv
        out = torch.mm(self.w, x.t())[:, :m].t().contiguous()  # [out, 2 or M] -> [M, out]
        return out if self.bias is None else out + self.bias


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from a fused gate/up output [..., 2 I] (gate first) -> [..., I]."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


class CastProjection:
    """One weight w [out, in] (and bias [out]) whose GEMM runs in `matmul_dtype`, result in x's dtype.

    matmul_dtype=torch.bfloat16 keeps a bf16 copy of the weight (fp32 accumulation); the residual
    stream around it keeps its dtype. On this CPU (avx512_bf16) that doubles GEMM throughput for
    batches of >= 32 rows. None: the weight's own dtype. A CPU weight (fp32, or bf16 where the CPU computes
    it natively) may instead run on a copy packed for oneDNN, where `tune_batched_layouts` timed that faster."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, matmul_dtype: torch.dtype | None):
        dtype = matmul_dtype or w.dtype
        self.w = w.detach().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.key = ("batched", tuple(w.shape), dtype, bias is not None, torch.get_num_threads())
        self.packed: torch.Tensor | None = None
        self.packed_halves: tuple[torch.Tensor, torch.Tensor] | None = None  # gate and up, packed: `gated`
        self.layout = "linear"

    @property
    def packable(self) -> bool:
        return cpu_tunable(self.w) and _packed_available(self.w.dtype)

    def use(self, layout: str) -> None:
        """Run every call through `layout` ("linear" or "packed") from now on."""
        if layout == "packed" and self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w, BATCHED_TIMED_ROWS)
        elif layout == "linear":
            self.packed = self.packed_halves = None
        self.layout = layout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.layout == "packed":
            out = self.run("packed", x.reshape(-1, x.shape[-1]))
            return out.view(*x.shape[:-1], -1)
        return self.run("linear", x)

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a fused gate/up weight [2 I, in], gate rows first: x [..., in] -> [..., I].

        On oneDNN's packed weights each half is its own GEMM with the rest fused into it (post-ops): silu
        on the gate's fp32 accumulator, the up GEMM's accumulator times that, rounded once to the GEMM's
        dtype, which the down projection then reads as is. Unfused, the [rows, 2 I] result was written,
        cast to fp32, read by silu and mul, and cast back: in a prefill of 5,120 positions on a 2-core AMX
        Xeon the forward's casts, multiplications and silu took twice the time of its GEMMs (torch.profiler),
        these the widest of them."""
        if self.layout != "packed":
            return silu_gate(self(x))
        if self.packed_halves is None:
            self.packed_halves = tuple(torch.ops.mkldnn._reorder_linear_weight(half, BATCHED_TIMED_ROWS)
                                       for half in self.w.chunk(2))
        packed_gate, packed_up = self.packed_halves
        bias_gate, bias_up = self.bias.chunk(2) if self.bias is not None else (None, None)
        rows = x.reshape(-1, x.shape[-1]).to(self.w.dtype).contiguous()
        gate = torch.ops.mkldnn._linear_pointwise(rows, packed_gate, bias_gate, "swish", [], "")
        out = torch.ops.mkldnn._linear_pointwise.binary(rows, gate, packed_up, bias_up, "mul")
        return out.view(*x.shape[:-1], -1)

    def run(self, layout: str, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [M, out] through one layout."""
        x_in = x.to(self.w.dtype)
        if layout == "packed":
            out = torch.ops.mkldnn._linear_pointwise(x_in.contiguous(), self.packed, self.bias, "none", [], "")
        else:
            out = F.linear(x_in, self.w, self.bias)
        return out.to(x.dtype)


# Batched decoding feeds a projection one row per active sequence (up to generate.batch_size) and prefill
# thousands. On a 2-core AVX2-only AMD EPYC (Zen 3), fp32, 2 threads, 64 rows: oneDNN on packed weights ran
# SmolLM2-135M's 49152x576 head in 28 ms against F.linear's 51, its 3072x576 gate/up in 1.6 against 1.9 ms.
# Whether it wins differs by CPU, so it is timed once per process and weight shape at this many rows.
BATCHED_TIMED_ROWS = 64


def tune_batched_layouts(projections: list[CastProjection]) -> None:
    """Give each CPU projection (fp32, or bf16 where native) the faster of F.linear and oneDNN's packed weights at
    BATCHED_TIMED_ROWS rows, timed over all projections of its shape (once per process and shape).
    A packed copy (this weight's memory again) is kept only where it won."""
    def fastest(group: list[CastProjection]) -> str:
        for projection in group:
            projection.use("packed")
        x = torch.randn(BATCHED_TIMED_ROWS, group[0].w.shape[1], generator=torch.Generator().manual_seed(0))
        return min(("linear", "packed"), key=lambda name: _seconds_per_pass(group, name, x))

    _tune_per_shape([p for p in projections if p.packable], fastest, CastProjection.use)
