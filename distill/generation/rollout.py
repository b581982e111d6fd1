"""On-policy data (generate.rollout_draft): the draft writes each completion, the target scores it (a
feature draft's rollouts: distill/generation/feature_rollout.py).

DistillSpec (arXiv 2310.08461) and online speculative decoding (2310.07177) train the draft on its own
samples labelled by the target: those are the contexts the decoder puts it in, and its rollouts cost
~2% of the target's generation, while the target only scores them in one batched prefill per row.
The draft samples through the same batched token loop and per-row uniform streams as target
generation (runner_engine.py), over the full vocabulary: a subset draft trained with spread_other is
expanded exactly (distill/export/hf_full.py), so its samples follow the distribution the decoder
draws from. The shards are those of generate-data (the same columns, manifest and resume), and the
plan's fingerprint names the draft and its weights' hash, so a resume with another draft is refused
and the manifest says which checkpoint made the folder.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from common.config import Config, ConfigError
from common.models import TOKENIZER_FILES, check_tokenizers, load_model, load_tokenizer, model_hash, \
    reference_problem
from decode.drafts.feature.model import CONFIG_FILE, FeatureDraft, check_target, feature_draft_problem, \
    is_feature_draft
from decode.vocab import model_vocab_size
from distill.export.hf_full import full_vocab_model
from distill.generation.engine import Completion, Engine, eos_ids
from distill.generation.feature_rollout import FeatureRolloutEngine
from distill.generation.plan import Row
from distill.generation.runner_engine import RunnerEngine


class RolloutEngine:
    """`Engine` whose completions come from one engine (the draft's) and top-k from another (the target's)."""

    def __init__(self, draft_engine: Engine, target_engine: Engine):
        self.draft_engine, self.target_engine = draft_engine, target_engine
        self.sampler = f"draft-rollout:{draft_engine.sampler}"

    def generate(self, rows: list[Row], sampling, max_new_tokens: int, teacher_topk: int,
                 seed: int) -> Iterator[list[Completion]]:
        done = 0
        for drafted in self.draft_engine.generate(rows, sampling, max_new_tokens, 0, seed):
            batch = rows[done:done + len(drafted)]  # an engine yields completions in row order
            done += len(drafted)
            forced = [dataclasses.replace(row, completion_ids=tuple(int(t) for t in c.completion_ids))
                      for row, c in zip(batch, drafted, strict=True)]
            scored = [c for part in self.target_engine.score(forced, teacher_topk) for c in part]
            yield [dataclasses.replace(s, finish_reason=d.finish_reason) for d, s in zip(drafted, scored, strict=True)]

    def score(self, rows: list[Row], teacher_topk: int) -> Iterator[list[Completion]]:
        return self.target_engine.score(rows, teacher_topk)


def check_rollout_draft(config: Config, target_tokenizer, feature_layers: list[int] | None) -> None:
    """Refuse, before any model loads, a rollout draft that cannot load or was made for another target (its
    tokenizer differs, or the run that trained it names another target), and rollouts whose states the folder
    would not keep: a feature draft's without generate.features (feature_layers None) or of other layers, a
    standalone draft's with them."""
    path = config.generate.rollout_draft
    feature = is_feature_draft(path)
    problem = feature_draft_problem(path) if feature else reference_problem(path)
    if problem:
        raise ConfigError(f"generate.rollout_draft: {problem}")
    if feature and feature_layers is None:
        raise ConfigError(f"generate.rollout_draft: {path!r} is a feature draft, which trains on the target's states "
                          "of its rollouts: set generate.features=true")
    if feature and (layers := json.loads((Path(path) / CONFIG_FILE).read_text())["target_layers"]) != feature_layers:
        raise ConfigError(f"generate.rollout_draft reads the target's layers {layers}, generate.features keeps "
                          f"layers {feature_layers}: set distill.feature_layers={layers}")
    if not feature and feature_layers is not None:
        raise ConfigError("generate.features stores the target's states for a feature draft; the standalone draft "
                          "at generate.rollout_draft trains on tokens: set one of them")
    if not feature or any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        check_tokenizers(target_tokenizer, load_tokenizer(path))
    recorded = Path(path) / "config.yaml"
    if recorded.is_file():
        import yaml

        trained_for = (yaml.safe_load(recorded.read_text()) or {}).get("target")
        if trained_for is not None and model_hash(trained_for) != model_hash(config.target):
            raise ConfigError(f"generate.rollout_draft: {path!r} was trained for target {trained_for!r}, "
                              f"not {config.target!r}; its samples would not be on-policy for this target")


def rollout_engine(config: Config, target_engine: RunnerEngine, make_runner) -> RolloutEngine:
    """The standalone draft at generate.rollout_draft over the full vocabulary, behind the same kind of runner
    as the target (`make_runner(model)`), in front of the target's engine."""
    draft = full_vocab_model(load_model(config.generate.rollout_draft))
    engine = RunnerEngine(make_runner(draft), target_engine.eos_ids, target_engine.batch_size,
                          target_engine.max_batch_tokens)
    return RolloutEngine(engine, target_engine)


def feature_rollout_engine(config: Config, device: torch.device, tokenizer) -> FeatureRolloutEngine:
    """The feature draft at generate.rollout_draft and the target, both in generate.dtype, behind the batched
    decoder's runners (distill/generation/feature_rollout.py)."""
    g = config.generate
    dtype = torch.bfloat16 if g.dtype == "bf16" else torch.float32
    target = load_model(config.target, device=device, dtype=dtype)
    draft = FeatureDraft.load(g.rollout_draft, device).to(dtype)
    check_target(draft.config, target.config, model_vocab_size(target))
    return FeatureRolloutEngine(target, draft, eos_ids(tokenizer, target.generation_config), g.rollout_k,
                                g.batch_size, g.max_batch_tokens)


def draft_identity(path: str) -> dict:
    """{'draft': path, 'draft_hash': its weights' hash, 'draft_step': the training step it was saved at}."""
    metrics = Path(path) / "metrics.json"
    step = json.loads(metrics.read_text()).get("step") if metrics.is_file() else None
    return {"draft": path, "draft_hash": model_hash(path), "draft_step": step}


def rollout_record(config: Config) -> dict:
    """The plan fingerprint's keys for the draft that made the rows (None when the target made them)."""
    path = config.generate.rollout_draft
    if path is None:
        return {"rollout_draft": None, "rollout_draft_hash": None}
    return {f"rollout_{key}": value for key, value in draft_identity(path).items()}
