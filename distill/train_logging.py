"""Metrics out of the training loop (main process only): metrics.jsonl, W&B, a tqdm bar.

W&B mode 'auto' means online only when the user is logged in (WANDB_API_KEY or a netrc entry
for api.wandb.ai), else offline: wandb 0.31 raises at init with no key and no mode. The run id
is kept in <out_dir>/wandb_run_id so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import netrc
import os
import uuid
from pathlib import Path

from tqdm.auto import tqdm

from decode.config import config_to_dict


def wandb_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


class RunLogger:
    def __init__(self, config, out_dir: Path, enabled: bool, start_step: int):
        self.enabled = enabled
        self.run = None
        self.bar = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out_dir / "metrics.jsonl"
        mode = wandb_mode(config.wandb.mode)
        if mode != "disabled":
            import wandb

            id_file = out_dir / "wandb_run_id"
            if not id_file.exists():
                id_file.write_text(uuid.uuid4().hex[:12])
            self.run = wandb.init(project=config.wandb.project, name=config.name, id=id_file.read_text().strip(),
                                  resume="allow", mode=mode, dir=str(out_dir), config=config_to_dict(config))
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
