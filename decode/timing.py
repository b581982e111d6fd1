"""Honest timing: device-synchronised wall clock, medians, and the cost model's c and r(k)."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

from decode.runners import Runner


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


DRAFT_RUN = 4


def _time_forward(runner: Runner, context_len: int, probe: torch.Tensor, full_vocab: bool = True) -> float:
    times: list[float] = []
    with timed(runner.device, times):
        runner.forward(probe, probe.shape[0], full_vocab)
    runner.rollback(context_len)
    return times[0]


def cost_model(target_runner: Runner, draft_runner: Runner, context: list[int], max_k: int,
               repeats: int = 9) -> dict:
    """Measure c = draft step / target step and r(k) = target forward over k+1 tokens / target step.

    Every repeat times the one-token steps and each (k+1)-token forward back to back, and the
    ratios are formed within a repeat before taking medians, so a slow moment on a shared
    machine moves numerator and denominator together instead of skewing one of them.
    """
    for runner in (target_runner, draft_runner):
        runner.reset()
        runner.forward(torch.tensor(context), 1)
    n = len(context)
    probes = {m: torch.tensor((context * (m // n + 1))[-m:]) for m in range(1, max_k + 2)}
    target_steps, draft_steps, c_ratios = [], [], []
    r_ratios: dict[int, list[float]] = {k: [] for k in range(1, max_k + 1)}
    for i in range(repeats + 1):  # the first round warms up allocations for every shape
        step = _time_forward(target_runner, n, probes[1])
        # Draft steps come in runs of k after each target forward (which evicts the draft's
        # weights from the CPU caches): time DRAFT_RUN consecutive steps, as the loop does (a
        # subset draft's logits stay over its rows there).
        draft = sum(_time_forward(draft_runner, n, probes[1], False) for _ in range(DRAFT_RUN)) / DRAFT_RUN
        verify = {k: _time_forward(target_runner, n, probes[k + 1]) for k in r_ratios}
        if i == 0:
            continue
        target_steps.append(step)
        draft_steps.append(draft)
        c_ratios.append(draft / step)
        for k, seconds in verify.items():
            r_ratios[k].append(seconds / step)
    return {"target_step_ms": 1e3 * statistics.median(target_steps),
            "draft_step_ms": 1e3 * statistics.median(draft_steps),
            "c": statistics.median(c_ratios), "r": {k: statistics.median(v) for k, v in r_ratios.items()},
            "context_tokens": n}
