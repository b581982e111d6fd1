"""Which dtype a stage computes in on this machine, and what to call the machine beside a figure.

`auto` means bf16 where the device computes it natively, else fp32. On CPUs without native bf16
(AVX2 only: older servers, many laptops and cloud VMs) torch emulates bf16 GEMMs: on a 2-core AMD
EPYC with AVX2, a [128 x 576] x [576 x 1536] GEMM ran at 8 GFLOP/s in bf16 against 44 in fp32, so a
bf16 generation took hours instead of 48 minutes. With avx512_bf16 or AMX the same GEMM ran ~4x
faster in bf16 than in fp32 (Sapphire Rapids class Xeon, 2 threads). The CPU flags say whether the
instructions exist; one timed GEMM of that shape each way (a few ms) confirms the libraries use them
(they may be limited, e.g. by ONEDNN_MAX_CPU_ISA).

    choice = resolve_dtype("auto", device, "generate.dtype")   # DtypeChoice('bf16', reason)
    print(choice.line)  # once per stage; choice.as_record() goes into plans, runs and reports
"""

from __future__ import annotations

import functools
import os
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch


# x86 flags of native bf16 arithmetic (/proc/cpuinfo "flags"), and aarch64's ("Features").
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# The GEMM timed each way: 128 rows (a generation batch) through SmolLM2-135M's MLP up-projection.
PROBE_SHAPE = (128, 576, 1536)
PROBE_ROUNDS = 9
"""Timed calls of each dtype."""
# bf16 must beat fp32 by this much to be chosen: a native bf16 GEMM ran ~4x faster, an emulated one
# 5-6x slower, so the margin only keeps timing noise from picking bf16 where the two tie.
BF16_MIN_SPEEDUP = 1.2


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a stage computes in ('fp32' or 'bf16'), as resolved from its config key, and why."""
    key: str
    """The config key it came from, e.g. 'generate.dtype'."""
    asked: str
    """'auto', 'fp32' or 'bf16' as configured."""
    name: str
    """'fp32' or 'bf16': what runs."""
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    @property
    def line(self) -> str:
        """The one line a stage prints: '<key>: auto -> bf16 (<why>)'."""
        asked = f"{self.asked} -> {self.name}" if self.asked != self.name else self.name
        return f"{self.key}: {asked} ({self.reason})"

    def as_record(self) -> dict:
        """What plans, runs and reports record: the resolved dtype, what was asked, why, and the CPU class."""
        return {"dtype": self.name, "asked": self.asked, "reason": self.reason, "machine": machine_class()}


def resolve_dtype(asked: str, device: str | torch.device, key: str) -> DtypeChoice:
    """'auto' -> bf16 where `device` computes it natively, else fp32. 'bf16' on a device without native
    bf16 warns with the measured slowdown and runs as asked; 'fp32' is always fp32."""
    if asked not in ("auto", "fp32", "bf16"):
        raise ValueError(f"{key}: {asked!r} is not 'auto', 'fp32' or 'bf16'")
    if asked == "fp32":
        return DtypeChoice(key, asked, "fp32", "as configured")
    native, why = native_bf16(torch.device(device))
    if asked == "bf16":
        if not native:
            warnings.warn(f"{key}=bf16 on a device without native bf16 ({why}); it runs as asked, but "
                          f"{key}=auto would choose fp32", stacklevel=2)
        return DtypeChoice(key, asked, "bf16", "as configured" + ("" if native else f"; {why}"))
    return DtypeChoice(key, asked, "bf16" if native else "fp32", why)


def resolve_decode_dtype(asked: str, device: str | torch.device) -> DtypeChoice:
    """eval.dtype: 'auto' is bf16 on a GPU with native bf16 and on a CPU with AMX, else fp32. On a CPU in bf16
    both the batch-1 runner and the serving table's batched one give every row the bits a one-token forward
    gives it (decode/runners/lean.py, decode/runners/ragged.py), so speculative output equals bf16
    target-only output token for token at every batch size.

    Batch-1 decoding feeds its GEMMs 1-65 rows. On a 2-core AMX Xeon, bf16 on oneDNN's packed weights ran
    them faster than fp32 at every count (one SmolLM2-135M forward's matmuls 7.7 vs 14.1 ms at 1 row, 11.5
    vs 44.1 at 33): the lean step took 0.80x the time and verifying 32 tokens 1.48 steps instead of 2.61.
    F.linear in bf16 had been 2.3x slower than fp32 at 1 row. Without AMX (avx512_bf16 alone, or AVX2)
    this was not measured faster, so those CPUs keep fp32."""
    device = torch.device(device)
    if asked != "auto" or device.type == "cuda":
        return resolve_dtype(asked, device, "eval.dtype")
    if "amx_bf16" in cpu_flags():
        native, why = native_bf16(device)
        if native:
            return DtypeChoice("eval.dtype", asked, "bf16", f"batch-1 decoding on a CPU with AMX: {why}; "
                                                            "packed bf16 GEMMs beat fp32 at 1-65 rows")
    return DtypeChoice("eval.dtype", asked, "fp32", "batch-1 decoding on a CPU without AMX: fp32 GEMMs are the "
                                                    "faster ones at 1-9 rows")


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """(whether `device` computes bf16 natively, the reason in words with the measured GEMM ratio)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} computes bf16 natively"
        return False, f"{name} has no native bf16"
    if device.type != "cpu":
        return False, f"no bf16 check for {device.type} devices"
    flags = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags())
    speedup = bf16_gemm_speedup()
    shape = "x".join(map(str, PROBE_SHAPE))
    measured = (f"a {shape} GEMM ran {speedup:.1f}x as fast in bf16 as in fp32 here" if speedup >= 1 else
                f"a {shape} GEMM ran {1 / speedup:.1f}x slower in bf16 than in fp32 here")
    if not flags:
        return False, f"this CPU has no avx512_bf16/amx_bf16, bf16 is emulated: {measured}"
    if speedup < BF16_MIN_SPEEDUP:
        return False, f"this CPU has {'/'.join(flags)}, but {measured}"
    return True, f"this CPU has {'/'.join(flags)}; {measured}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def bf16_gemm_speedup() -> float:
    """fp32 time / bf16 time of one PROBE_SHAPE GEMM on one core of this CPU: the best of PROBE_ROUNDS
    each, the two dtypes alternating after a warm-up (~30-150 ms). One thread, because the question is
    what the core computes natively: on 2 cores with other work running, a 2-thread GEMM waits for
    whichever thread is descheduled, and the ratio fell from 4.0 to 1.1-2.8 (one thread: 4.0 either way)."""
    m, k, n = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator)
    operands = {dtype: (x.to(dtype), w.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(operands, float("inf"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for round_ in range(PROBE_ROUNDS + 1):
            for dtype, (xd, wd) in operands.items():
                start = time.perf_counter()
                torch.nn.functional.linear(xd, wd)
                if round_:  # round 0 warms up (oneDNN picks and compiles its kernels on the first call)
                    best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]


def isa_class() -> str:
    """The CPU's widest vector/matrix extensions, as figures name them: 'AVX-512 BF16 + AMX', 'AVX-512',
    'AVX2', ... (from the flags; what a library may be limited to by ONEDNN_MAX_CPU_ISA is added)."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        isa = "AVX-512 BF16 + AMX"
    elif "avx512_bf16" in flags:
        isa = "AVX-512 BF16"
    elif "avx512f" in flags:
        isa = "AVX-512"
    elif "avx2" in flags:
        isa = "AVX2"
    elif "bf16" in flags:
        isa = "Arm BF16"
    else:
        isa = platform.machine() or "unknown ISA"
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"{isa}, limited to {limit}" if limit else isa


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def machine_class(device: str | torch.device = "cpu") -> str:
    """What to write beside a figure: 'Intel(R) Xeon(R) Processor (AVX-512 BF16 + AMX), 2 cores, 2 threads'."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({isa_class()}), {os.cpu_count()} cores, {torch.get_num_threads()} threads"

