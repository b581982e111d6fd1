"""An exponential moving average of the draft's trainable weights (distill.ema_decay).

A small draft trained at a high learning rate ends on weights that jitter from step to step; their
average over the last few hundred steps predicts the target better than any one step (at the demo's
budget, decay 0.995: exact held-out α +0.007-0.016 over the best evaluated step, docs/results.md). Training
goes on from the last step's weights; evaluations and exports read the average.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


class WeightAverage:
    """After optimizer step t, average ← average + max(1 - decay, 1 / t) · (weights - average): the plain
    mean of the steps so far until 1 / (1 - decay) of them, an exponential average from then on, so a short
    run's average does not lean on the initial weights. Checkpointed with the run (state_dict)."""

    def __init__(self, params, decay: float):
        self.params = [p for p in params if p.requires_grad]
        self.decay = decay
        self.average = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights after optimizer step `step` (1 = the first)."""
        weight = max(1 - self.decay, 1 / step)
        for average, param in zip(self.average, self.params):
            average.lerp_(param.detach(), weight)

    @contextmanager
    def swapped_in(self):
        """The average in the model's weights inside the block, the training weights back after it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for average, param in zip(self.average, self.params):
            held = param.detach().clone()
            param.copy_(average)
            average.copy_(held)

    def state_dict(self) -> dict:
        return {"average": self.average}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for average, saved in zip(self.average, state["average"], strict=True):
                average.copy_(saved)
