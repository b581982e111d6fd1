"""Progress that tells the truth on a slow machine.

A long stage's bar moves by finished units of work (a generation batch, a training step), never by the
first row of a batch: batched generation returns 128 rows at once after minutes, and a bar moved row by
row read "1/2530 [07:02<296:47:49]" in between. Rates are averaged over the whole run (tqdm's
smoothing=0), so the ETA is the remaining work at the rate measured so far. After its first unit, every
long stage prints one line saying how long it expects to take on this machine (`expectation`).
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from common.precision import machine_class


def duration(seconds: float) -> str:
    """41 s, 14 min, 2.3 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def expectation(stage: str, done: float, total: float, elapsed_s: float, unit: str) -> str:
    """'<stage>: the first 128 of 2,530 rows took 41 s; expect ~14 min in all on <machine class>'."""
    expected = elapsed_s * total / done if done else float("nan")
    return (f"{stage}: the first {done:,.0f} of {total:,.0f} {unit} took {duration(elapsed_s)}; "
            f"expect ~{duration(expected)} in all on this machine ({machine_class()})")


class BatchProgress:
    """A bar over `total` units moved once per finished batch, with tokens/s, and one expectation line
    (stderr) after the first batch. `total_tokens` > 0, where the tokens to come are known (score mode:
    the texts it is teacher-forced over), scales the expectation by tokens instead: rows of scored text
    differ in length, and on 1,743 Python functions the first 128 rows (short ones) said ~4 minutes for a
    run of 8.9."""

    def __init__(self, stage: str, total: int, unit: str, enabled: bool = True, total_tokens: int = 0):
        self.stage, self.total, self.unit, self.enabled = stage, total, unit, enabled
        self.total_tokens = total_tokens
        self.bar = tqdm(total=total, unit=unit, desc=stage, disable=not enabled, dynamic_ncols=True, smoothing=0)
        self.start = time.perf_counter()
        self.done = self.tokens = 0

    def batch_done(self, units: int, tokens: int = 0) -> None:
        self.done += units
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        if tokens or self.tokens:
            self.bar.set_postfix(tok_s=f"{self.tokens / elapsed:.0f}", refresh=False)
        self.bar.update(units)
        if self.enabled and self.done == units and self.done < self.total:  # the first batch
            done, total, unit = ((self.tokens, self.total_tokens, "tokens") if self.total_tokens and self.tokens
                                 else (self.done, self.total, self.unit))
            self.bar.write(expectation(self.stage, done, total, elapsed, unit), file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
