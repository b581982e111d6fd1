"""Weights & Biases for every stage: offline unless the user is logged in; wandb imported lazily.

wandb 0.31 raises at init when there is no API key and no mode, so 'auto' resolves to
'online' only with WANDB_API_KEY or a netrc entry for api.wandb.ai, else 'offline'.
"""

from __future__ import annotations

import netrc
import os
import uuid
from pathlib import Path


def _logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(mode: str) -> str:
    """'auto' -> the user's WANDB_MODE if set, else 'online' when logged in, else 'offline'."""
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if _logged_in() else "offline")


def start_wandb(mode: str, project: str, name: str, out_dir: Path, config: dict, job_type: str,
                resume_id_file: Path | None = None):
    """A wandb run, or None when disabled. With `resume_id_file`, a restarted job continues
    the same W&B run (the id is kept in that file)."""
    mode = wandb_mode(mode)
    if mode == "disabled":
        return None
    os.environ["WANDB_MODE"] = mode
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    out_dir.mkdir(parents=True, exist_ok=True)
    run_id = None
    if resume_id_file is not None:
        if not resume_id_file.exists():
            resume_id_file.write_text(uuid.uuid4().hex[:12])
        run_id = resume_id_file.read_text().strip()
    return wandb.init(project=project, name=name, dir=str(out_dir), config=config, mode=mode,
                      job_type=job_type, id=run_id, resume="allow" if run_id else None)
