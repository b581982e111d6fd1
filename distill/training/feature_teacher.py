"""The frozen target run online for a feature draft: what the draft reads and what it is trained towards.

Alignment (distill/data.py: position t of the input predicts token t + 1): the draft at position i
reads the target's hidden states at i and the target's embedding of token i + 1 (= labels[i]), and
predicts token i + 2, whose teacher is the target's distribution at position i + 1. So draft position
i is trained where the target's position i + 1 predicts a completion token (loss_mask[i + 1]); a
completion token predicted at position 0 (a one-token prompt) has no draft position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

from distill.training.teacher import forward_at


@dataclass
class FeatureBatch:
    hidden: torch.Tensor
    """[B, T, len(layers), H] the target's hidden states of the layers the draft reads."""
    embeds: torch.Tensor
    """[B, T, H] the target's embedding of token i + 1 at position i."""
    positions: torch.Tensor
    """[B, T] bool: draft positions with a teacher (n of them)."""
    target_logp: torch.Tensor
    """[n, N] the target's log-probs (softmax over its FULL vocabulary, T = 1) of the draft's N subset
    tokens at those positions, row-major: each row sums to the target's mass inside the subset."""
    target_top1: torch.Tensor
    """[n] the target's most likely full-vocabulary id."""
    finite: bool
    """False when the target's logits hold NaN or inf (the step is then skipped)."""


def forward_keeping_layers(model, layers: list[int], head_at: torch.Tensor | None = None, **inputs):
    """(`model(**inputs)`, or `forward_at(model, head_at, **inputs)` with the head at the head_at positions only;
    [B, T, len(layers), H] the outputs of its decoder `layers`), the last layer's after
    the final norm: what output_hidden_states reports as hidden_states[i + 1], and decode/runners keep at
    decode time. Forward hooks keep only those layers' outputs (the same bits as output_hidden_states, which
    holds every layer's: 31 x [B, T, H] for SmolLM2), and `model` may be a decoder without a head."""
    decoder = extract_model_from_parallel(model).get_decoder()
    last = len(decoder.layers) - 1
    kept: dict[int, torch.Tensor] = {}

    def keep(i, module, args, output):
        kept[i] = output[0] if isinstance(output, tuple) else output

    handles = [(decoder.norm if i == last else decoder.layers[i]).register_forward_hook(partial(keep, i))
               for i in layers]
    try:
        out = model(**inputs) if head_at is None else forward_at(model, head_at, **inputs)
    finally:
        for handle in handles:
            handle.remove()
    return out, torch.stack([kept[i] for i in layers], dim=2)


class FeatureTeacher:
    def __init__(self, target, layers: list[int], subset_ids: torch.Tensor, dtype: torch.dtype):
        self.target = target.eval().requires_grad_(False)
        self.layers = list(layers)
        self.subset_ids = subset_ids  # [N] on the target's device
        self.dtype = dtype  # the draft's: the target may run in bf16

    @torch.no_grad()
    def __call__(self, batch: dict) -> FeatureBatch:
        loss_mask = batch["loss_mask"]
        positions = F.pad(loss_mask[:, 1:], (0, 1))  # [B, T]: draft position i <- target position i + 1
        teacher_at = F.pad(loss_mask[:, 1:], (1, 0))  # [B, T]: those target positions i + 1
        out, hidden = forward_keeping_layers(self.target, self.layers, teacher_at, input_ids=batch["input_ids"],
                                             attention_mask=batch["attention_mask"])
        hidden = hidden.to(self.dtype)
        embeds = self.target.get_input_embeddings()(batch["labels"]).to(self.dtype)
        logits = out.logits[0].float()  # [n, V]
        target_logp = torch.log_softmax(logits, -1)[:, self.subset_ids]  # [n, N]
        return FeatureBatch(hidden, embeds, positions, target_logp, logits.argmax(-1),
                            bool(torch.isfinite(logits).all()))


def step_masks(positions: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """[B, T] bool per unrolled step j: the positions with a teacher where step j has context. Step j
    at i has read the target's features only up to i - j, so positions i < j have none: left out."""
    i = torch.arange(positions.shape[1], device=positions.device)
    return [positions & (i >= j) for j in range(steps)]
