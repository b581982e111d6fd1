"""The matmul of one weight matrix, laid out for the rows each cache layout feeds it.

Both are called as projection(x) = x @ w.T (+ bias) on x [..., in]:
  Projection      batch 1: a handful of rows per forward, where the layout decides the speed
  CastProjection  batched: many rows, optionally in bf16 (GEMM throughput)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Row counts (M) and layouts, measured on a 2-core AMD EPYC (Zen 4), fp32, 1 thread, ms for the
# matmuls of one SmolLM2-135M forward (30 layers + output head, weights streamed from memory):
#                         M = 1    2    3    5    9   12
#   torch.mm(w, x.T) (MKL)   30   31   50   61  111  146
#   oneDNN, packed weights   38   49   32   30   41   46
# (F.linear, layers only, another run: 35 58 69 56 64 for M = 1, 2, 3, 5, 9.)
# MKL runs 1-2 rows at memory speed but 3+ rows at a fraction of the core's AVX-512 peak;
# oneDNN with weights reordered once into its blocked layout runs 3-12 rows in about the time
# of one. So M >= PACKED_MIN_M uses the packed weights, M <= 2 uses w @ x.T (one row duplicated
# into two), except a small draft's layers (fewer than MIN_IN inputs and MIN_OUT outputs), where
# gemv is faster: 28-117 us vs 38-116 us per pair of layers. A draft's output head (8192 x 192
# for the demo's) is wide enough for w @ x.T to win: 0.38 ms vs 0.80 ms.
PACKED_MIN_M = 3
MIN_IN = 256
MIN_OUT = 4096


def _packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Projection:
    """One weight w [out, in] (and bias [out]) in the layout each row count runs fastest in.

    Only CPU fp32 has a choice of layouts; elsewhere this is F.linear. The packed copy (CPU fp32)
    doubles this weight's memory."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, cpu_fp32: bool):
        self.w, self.bias = w, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 8) if cpu_fp32 and _packed_available() else None
        # w @ x.T for 1-2 rows, except a small draft layer's weight (gemv is faster there).
        self.mm_for_few_rows = cpu_fp32 and not (w.shape[1] < MIN_IN and w.shape[0] < MIN_OUT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> contiguous [M, out]."""
        m = x.shape[0]
        if self.packed is not None and m >= PACKED_MIN_M:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if m >= PACKED_MIN_M or not self.mm_for_few_rows:
            return F.linear(x, self.w, self.bias)
        x = x.contiguous()
        if m == 1:
            x = torch.cat([x, x])  # [2, in]
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
