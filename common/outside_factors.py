"""Where a draft's factored outside rows (decode/vocab.py, distill.outside_rank) live on disk: the rank in its HF
config, and the factors U, the draft module's parameter FACTORS_NAME, in a file of their own beside
model.safetensors (so HF tools reading the folder see a plain Llama). Loaders (common.models.load_model) attach U."""

from __future__ import annotations

from pathlib import Path

import torch

from common.errors import UserError


RANK_ATTR = "draft_outside_rank"
FACTORS_NAME = "outside_factors"
OUTSIDE_FILE = "outside_factors.safetensors"


class MissingFactorsError(UserError):
    """A draft folder whose config names factored outside rows without the file that holds them."""


def attach_outside_factors(model: torch.nn.Module, factors: torch.Tensor) -> None:
    """Give a draft model its outside factors U as a trainable parameter (saved by its state dict)."""
    setattr(model, FACTORS_NAME, torch.nn.Parameter(factors.contiguous()))  # an SVD gives column-major rows


def load_outside_factors(model: torch.nn.Module, folder: str | Path) -> None:
    """Attach the U saved in `folder` to a factored draft loaded from it (a no-op for any other model)."""
    rank = int(getattr(model.config, RANK_ATTR, 0))
    if not rank:
        return
    from safetensors.torch import load_file

    path = Path(folder) / OUTSIDE_FILE
    if not path.is_file():
        raise MissingFactorsError(f"{folder} is a draft with factored outside rows (its config's {RANK_ATTR}) but "
                                  f"lacks {OUTSIDE_FILE}: copy the whole folder, or export it again")
    weight = next(model.parameters())
    attach_outside_factors(model, load_file(path)[FACTORS_NAME].to(weight.device, weight.dtype))
