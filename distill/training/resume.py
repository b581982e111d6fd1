"""Which settings a resumed run may change.

A run resumes from its latest checkpoint only under the settings it was started with (the
config.yaml it wrote), except those that bound the run or only report on it: changing the
learning rate, the loss, the data or the model halfway would give a draft that no single
config describes, so that is refused, naming the settings.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from common.config import ConfigError, config_to_dict
from common.models import resolve_device
from common.precision import resolve_dtype


# How long the run goes, how often it evaluates/saves, and what it reports: the weights of a step
# do not depend on them. distill.max_steps also sets where the cosine schedule ends when
# distill.lr_schedule_steps is 0, so raising it to continue a finished run changes the learning rate
# of the steps after the resume (allowed: that is what continuing means); lr_schedule_steps itself
# sets the schedule of every step and may not change. The other stages' sections (generate, eval,
# engines, draft) are not read here.
MAY_CHANGE = ("name", "draft", "generate.", "eval.", "engines.", "wandb.", "distill.out_dir", "distill.resume",
              "distill.max_steps", "distill.max_minutes", "distill.stop_after", "distill.eval_every",
              "distill.save_every", "distill.keep_checkpoints", "distill.early_stop_patience",
              "distill.max_bad_steps", "distill.tau_k", "distill.export")

# Settings added to the schema after runs were made, each with the value that does what those runs did
# (a run written before distill.data_weights existed read every row once per epoch; one before
# distill.filter_hardest, every position; one before distill.ema_decay, the last step's weights; one before
# distill.group_by_length, steps drawn at random; one before distill.ttt_reach, every position of a step alike).
ADDED_SETTINGS = {"distill.data_weights": [], "distill.filter_hardest": 0.0, "distill.ema_decay": 0.0,
                  "distill.group_by_length": 0, "distill.ttt_reach": False}


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "loss":  # distill.loss is one setting (a weight map)
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class _Absent:
    """A setting one of the two configs lacks (the config schema changed in between)."""

    def __repr__(self) -> str:
        return "(absent)"


def changed_settings(before: dict, now: dict) -> list[str]:
    """'key: old -> new' for each setting that differs and may not change on a resume. A setting of
    ADDED_SETTINGS that the run's config.yaml lacks has the value every run had before it existed."""
    before, now, absent = _flatten(before), _flatten(now), _Absent()
    before = {**{key: value for key, value in ADDED_SETTINGS.items() if key in now}, **before}
    return [f"{key}: {before.get(key, absent)!r} -> {now.get(key, absent)!r}"
            for key in sorted(before.keys() | now.keys())
            if not key.startswith(MAY_CHANGE) and before.get(key, absent) != now.get(key, absent)]


def check_resumable(config, out_dir: Path, checkpoint: Path) -> None:
    """Raise ConfigError when `config` changes a setting the run in out_dir was started with."""
    written = out_dir / "config.yaml"
    if not written.is_file():
        raise ConfigError(f"cannot resume from {checkpoint}: {written} is missing, so the run's settings are "
                          f"unknown; train into a new distill.out_dir")
    before = yaml.safe_load(written.read_text())
    if before.get("distill", {}).get("precision") == "auto":  # written before 'auto' was resolved in the run
        before["distill"]["precision"] = resolve_dtype("auto", resolve_device(config.device), "distill.precision").name
    changed = changed_settings(before, config_to_dict(config))
    if changed:
        raise ConfigError(f"cannot resume from {checkpoint} with changed settings (the run was started with "
                          f"{written}):\n  " + "\n  ".join(changed) +
                          "\nput them back, or train into a new distill.out_dir")
