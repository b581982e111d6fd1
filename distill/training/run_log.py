"""Metrics out of the training loop (main process only): metrics.jsonl, W&B, a tqdm bar.

metrics.jsonl holds one row per logged step. A run that starts from step N (a resume, or a
fresh start in a folder a crashed run left) first drops the rows of steps after N: those steps
are replayed, and their rows would otherwise appear twice.

W&B (common.tracking): offline unless the user is logged in. The run id is kept in
<out_dir>/wandb_run_id so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tqdm.auto import tqdm

from common.config import config_to_dict
from common.tracking import start_wandb


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the rows of steps <= last_step (written to a temp file, then renamed)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    kept = [line for line in lines if _row_step(line) <= last_step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except json.JSONDecodeError:  # a row torn by a kill mid-write: dropped with the replayed ones
        return math.inf


class RunLogger:
    def __init__(self, config, out_dir: Path, enabled: bool, start_step: int):
        self.enabled = enabled
        self.run = None
        self.bar = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out_dir / "metrics.jsonl"
        truncate_metrics(self.metrics_path, start_step)
        self.run = start_wandb(config.wandb.mode, config.wandb.project, config.name, out_dir,
                               config_to_dict(config), job_type="distill", resume_id_file=out_dir / "wandb_run_id")
        self.bar = tqdm(total=config.distill.max_steps, initial=start_step, desc="distill", dynamic_ncols=True)

    def log(self, step: int, metrics: dict, show: dict | None = None) -> None:
        if not self.enabled:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)
        if show is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in show.items()}, refresh=False)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def message(self, text: str) -> None:
        if self.enabled:
            tqdm.write(text)

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.summary.update(summary)
            self.run.finish()
