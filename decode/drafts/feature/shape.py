"""Build a feature draft (decode/drafts/feature/model.py) sized to a parameter ratio of its target.

Most of a feature draft is fixed by the target: at the target's width H, reading L of its layers,
`fc` (L·H x H), attention over [embedding, hidden] (2H -> q, k, v, then o) and four norms. Only the
MLP width I (3·H·I weights) and the head's rows N (H·N) are free. For SmolLM2-135M (H = 576, 9/3
heads of 64, L = 3) the fixed part is 2.44M = 1.81% of the target, so 3% (4.03M) leaves 1.60M: e.g.
2,048 head rows (1.18M) and an MLP of 240 (0.41M). The target's embedding, which the draft reuses for
the next token, is not counted: it adds nothing to the target.

When neither is set, the head gets three quarters of what is left, because acceptance can never
exceed the target's mass inside the head's subset (on 320 of the demo's prompts 1,024 / 2,048 /
4,096 rows hold 77% / 82% / 87% of the stored top-32 mass), while the MLP only adds capacity to a
layer whose input already is the target's own state.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from common.config import ConfigError
from decode.drafts.feature.model import FeatureDraft, FeatureDraftConfig, default_target_layers


HEAD_ROWS_MULTIPLE = 64  # whole 64-row tiles for the head's matmul
MLP_MULTIPLE = 16
AUTO_HEAD_SHARE = 0.75


@dataclass
class FeatureShape:
    layers: list[int]
    intermediate_size: int
    head_rows: int
    params: int
    fixed_params: int
    """fc, attention and norms: what the target's width and the number of layers read fix."""
    ratio: float

    def describe(self, target_params: int, width: int, num_layers: int) -> str:
        return (f"feature draft: width {width}, reads layers {self.layers} of {num_layers}, mlp "
                f"{self.intermediate_size}, {self.head_rows} head rows -> {self.params / 1e6:.2f}M params "
                f"= {self.ratio:.2%} of the target's {target_params / 1e6:.1f}M (fixed {self.fixed_params / 1e6:.2f}M, "
                f"mlp {3 * width * self.intermediate_size / 1e6:.2f}M, head {width * self.head_rows / 1e6:.2f}M)")


def feature_layers(requested: list[int], num_layers: int, target_ref: str) -> list[int]:
    """The target layers the draft reads: `requested`, or the default low/middle/high ones. Raises
    ConfigError naming the target's layer count when one of them does not exist."""
    layers = list(requested) or default_target_layers(num_layers)
    if all(0 <= i < num_layers for i in layers) and len(set(layers)) == len(layers):
        return layers
    which = f"distill.feature_layers={layers}" if requested else (
        f"the default feature layers {layers} (distill.feature_layers is empty)")
    raise ConfigError(f"{which}: the target {target_ref} has {num_layers} decoder layers (0..{num_layers - 1}); "
                      f"list distinct layers in that range in distill.feature_layers")


def _params(config: FeatureDraftConfig) -> int:
    """The draft's own count, its weights on the meta device (its id map on the CPU, where it is checked)."""
    with torch.device("meta"):
        draft_ids = torch.arange(config.draft_vocab_size, device="cpu")
        return FeatureDraft(config, draft_ids).num_params()


def _fixed_params(target_config, layers: list[int]) -> int:
    """The weights that do not depend on the MLP width (3·H·I) or the head's rows (H·N)."""
    width, rows, mlp = target_config.hidden_size, HEAD_ROWS_MULTIPLE, MLP_MULTIPLE
    return _params(FeatureDraftConfig.for_target(target_config, layers, mlp, rows)) - 3 * width * mlp - width * rows


def choose_feature_shape(target_config, target_params: int, param_ratio: float, layers: list[int],
                         head_rows: int = 0, intermediate_size: int = 0) -> tuple[FeatureDraftConfig, FeatureShape]:
    """The draft's config: `head_rows` / `intermediate_size` as given, 0 = sized so the whole draft stays
    within param_ratio x target_params (the head first, AUTO_HEAD_SHARE of the room; the MLP the rest)."""
    width = target_config.hidden_size
    fixed = _fixed_params(target_config, layers)
    room = param_ratio * target_params - fixed
    if not head_rows:
        head_room = room - 3 * width * intermediate_size if intermediate_size else AUTO_HEAD_SHARE * room
        head_rows = int(head_room / width) // HEAD_ROWS_MULTIPLE * HEAD_ROWS_MULTIPLE
    if not intermediate_size:
        intermediate_size = int((room - width * head_rows) / (3 * width)) // MLP_MULTIPLE * MLP_MULTIPLE
    if head_rows < HEAD_ROWS_MULTIPLE or intermediate_size < MLP_MULTIPLE:
        raise ConfigError(
            f"distill.param_ratio={param_ratio}: a feature draft at width {width} reading {len(layers)} layers has "
            f"{fixed / 1e6:.2f}M fixed params ({fixed / target_params:.2%} of the target), which leaves no room for "
            f"its head and MLP; raise distill.param_ratio (0.03 is the usual top) or read fewer layers")
    config = FeatureDraftConfig.for_target(target_config, layers, intermediate_size, head_rows)
    params = _params(config)
    if not 0.01 <= params / target_params <= 0.03:
        warnings.warn(f"the feature draft has {params / target_params:.2%} of the target's parameters (usual: 1-3%)")
    return config, FeatureShape(layers, intermediate_size, head_rows, params, fixed, params / target_params)


@torch.no_grad()
def build_feature_draft(target, config: FeatureDraftConfig, draft_ids: torch.Tensor, head_init: str,
                        seed: int) -> FeatureDraft:
    """A fresh feature draft. head_init 'target' starts its head as the target's head rows of the subset
    and its final norm as the target's: the draft writes into the target's residual stream (its residual
    is the target's fused hidden state), so the target's own read-out of that stream is a better start
    than random rows, and the 576 x N head (the draft's largest matrix) need not be learnt from scratch."""
    torch.manual_seed(seed)
    draft = FeatureDraft(config, draft_ids)
    if head_init == "target":
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
        draft.norm.weight.copy_(target.get_decoder().norm.weight)
    elif head_init != "random":
        raise ValueError(f"head_init={head_init!r}; use 'target' or 'random'")
    return draft
