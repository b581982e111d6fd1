"""Honest timing: device-synchronised wall clock, medians, and the cost model's c and r(k)."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

from decode.runner import ModelRunner


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device, out: list):
    """Append the wall-clock seconds of the block to `out`, with the device synchronised on both ends."""
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    out.append(time.perf_counter() - start)


def forward_latency(runner: ModelRunner, context: list[int], n_tokens: int, repeats: int) -> float:
    """Median seconds of one forward over n_tokens new tokens after `context` (cache rolled back each time)."""
    runner.reset()
    runner.forward(torch.tensor(context), 1)
    probe = torch.tensor(context[-n_tokens:] if len(context) >= n_tokens else [context[-1]] * n_tokens)
    times: list[float] = []
    for _ in range(repeats + 1):  # the first call warms up allocations for this shape
        with timed(runner.device, times):
            runner.forward(probe, n_tokens)
        runner.rollback(len(context))
    return statistics.median(times[1:])


def cost_model(target_runner: ModelRunner, draft_runner: ModelRunner, context: list[int], max_k: int,
               repeats: int = 7) -> dict:
    """Measure c = draft step / target step and r(k) = target forward over k+1 tokens / target step."""
    target_step = forward_latency(target_runner, context, 1, repeats)
    draft_step = forward_latency(draft_runner, context, 1, repeats)
    r = {k: forward_latency(target_runner, context, k + 1, repeats) / target_step for k in range(1, max_k + 1)}
    return {"target_step_ms": 1e3 * target_step, "draft_step_ms": 1e3 * draft_step,
            "c": draft_step / target_step, "r": r, "context_tokens": len(context)}
