"""Metrics out of the training loop (main process only): metrics.jsonl, W&B, a tqdm bar.

W&B (decode.tracking): offline unless the user is logged in. The run id is kept in
<out_dir>/wandb_run_id so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from decode.config import config_to_dict
from decode.tracking import start_wandb


class RunLogger:
    def __init__(self, config, out_dir: Path, enabled: bool, start_step: int):
        self.enabled = enabled
        self.run = None
        self.bar = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out_dir / "metrics.jsonl"
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
