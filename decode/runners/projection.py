"""The matmul of one weight matrix, laid out for the rows each cache layout feeds it.

Both are called as projection(x) = x @ w.T (+ bias) on x [..., in]:
  Projection      batch 1: a handful of rows per forward, where the layout decides the speed
  CastProjection  batched: many rows, optionally in bf16 (GEMM throughput)
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

# Row counts (M) and layouts, measured on a 2-core AMD EPYC (Zen 4), fp32, 1 thread, ms for the
# matmuls of one SmolLM2-135M forward (30 layers + output head, weights streamed from memory):
#                         M = 1    2    3    5    9   12
#   torch.mm(w, x.T) (MKL)   30   31   50   61  111  146
#   oneDNN, packed weights   38   49   32   30   41   46
# On a Sapphire Rapids class Xeon (AVX-512 FP16/AMX) the packed path was a third faster than that
# CPU's choice for a few rows too, and a small draft's layers run fastest as plain gemv (F.linear).
# No one rule holds on every CPU, so each weight shape times its layouts once per process, when a
# runner is built (`choose_layouts`: ~0.1 s for SmolLM2-135M's seven shapes), and keeps the fastest
# for few rows (timed at FEW_ROWS, used up to FEW_MAX_ROWS) and for more (timed at MANY_ROWS).
LAYOUTS = ("linear", "mm", "packed")
"""F.linear; torch.mm(w, x.T) with one row duplicated into two; oneDNN on weights packed once."""
FEW_ROWS, MANY_ROWS = 1, 5
FEW_MAX_ROWS = 2
TIMING_REPEATS = 3
_measured: dict[tuple, tuple[str, str]] = {}


def _packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _best_seconds(fn, x: torch.Tensor) -> float:
    """The fastest of TIMING_REPEATS calls after one warm-up."""
    fn(x)
    times = []
    for _ in range(TIMING_REPEATS):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return min(times)


class Projection:
    """One weight w [out, in] (and bias [out]) in the layout each row count runs fastest in.

    Only CPU fp32 has a choice of layouts (measured per weight shape, or given as (few, many));
    elsewhere this is F.linear. A packed copy (doubling this weight's memory) is kept only where a
    packed layout won."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, cpu_fp32: bool,
                 layouts: tuple[str, str] | None = None):
        self.w, self.bias = w, bias
        key = (tuple(w.shape), bias is not None, torch.get_num_threads())
        layouts = ("linear", "linear") if not cpu_fp32 else layouts or _measured.get(key)
        want_packed = cpu_fp32 and _packed_available() and (layouts is None or "packed" in layouts)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 8) if want_packed else None
        if layouts is None:
            layouts = _measured[key] = self.choose_layouts()
        if "packed" in layouts and self.packed is None:
            raise ValueError("the packed layout needs oneDNN (torch.backends.mkldnn) and a CPU fp32 weight")
        self.few, self.many = layouts
        if "packed" not in layouts:
            self.packed = None

    def choose_layouts(self) -> tuple[str, str]:
        """(fastest layout at FEW_ROWS, fastest at MANY_ROWS) of this weight, timed here and now."""
        gen = torch.Generator().manual_seed(0)
        candidates = [name for name in LAYOUTS if name != "packed" or self.packed is not None]
        chosen = []
        for m in (FEW_ROWS, MANY_ROWS):
            x = torch.randn(m, self.w.shape[1], generator=gen, dtype=self.w.dtype)
            chosen.append(min(candidates, key=lambda name: _best_seconds(lambda v: self.run(name, v), x)))
        return chosen[0], chosen[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> contiguous [M, out]."""
        return self.run(self.few if x.shape[0] <= FEW_MAX_ROWS else self.many, x)

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


class CastProjection:
    """One weight w [out, in] (and bias [out]) whose GEMM runs in `matmul_dtype`, result in x's dtype.

    matmul_dtype=torch.bfloat16 keeps a bf16 copy of the weight (fp32 accumulation); the residual
    stream around it keeps its dtype. On this CPU (avx512_bf16) that doubles GEMM throughput for
    batches of >= 32 rows. None: the weight's own dtype."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, matmul_dtype: torch.dtype | None):
        dtype = matmul_dtype or w.dtype
        self.w = w.detach().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        return F.linear(x.to(self.w.dtype), self.w, self.bias).to(x.dtype)
