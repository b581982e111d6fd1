"""AdamW over the trainable parameters and its learning-rate schedule."""

from __future__ import annotations

import math

import torch


def lr_lambda(dc):
    """Linear warmup over warmup_steps, then cosine decay to 10% of lr at lr_schedule_steps
    (0 = max_steps; nanoGPT). A horizon past max_steps stops the run before the LR has decayed."""
    horizon = dc.lr_schedule_steps or dc.max_steps

    def factor(step: int) -> float:
        if step < dc.warmup_steps:
            return (step + 1) / dc.warmup_steps
        progress = min(1.0, (step - dc.warmup_steps) / max(1, horizon - dc.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def make_optimizer(model, dc):
    """(AdamW, LambdaLR) for the parameters that require grad (all of them, or LoRA's)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=dc.lr, weight_decay=dc.weight_decay, betas=(0.9, 0.95))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(dc))
