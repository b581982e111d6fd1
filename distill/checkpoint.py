"""Checkpoints that are complete or absent, and resume.

Layout of a run folder:
  config.yaml              the resolved config of the latest start or resume (a resume may change only
                           the settings that bound the run: distill/training/resume.py)
  metrics.jsonl            one row per logged step (rows past the step a run restarts from are dropped)
  checkpoints/step-N/      accelerate state (model, optimizer, scheduler, RNG of every rank)
                           + train_state.json (step, best α, ...) + COMPLETE (written last)
  checkpoints/.tmp-step-N/ a save in progress; never read, replaced by the next save
  best/                    HF export of the draft with the best held-out α so far (distill/export/)
  final/                   HF export (draft + tokenizer + config.yaml + metrics.json)

A save writes everything into .tmp-step-N, then the main process writes COMPLETE and renames
the folder to step-N (atomic on one filesystem). A crash or full disk mid-save leaves only the
tmp folder; the previous step-M stays the latest valid checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER = "COMPLETE"
STATE_FILE = "train_state.json"


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken or skipped (= the data position: the sampler is a function of it)."""
    best_alpha: float = -1.0
    best_step: int = 0
    evals_since_best: int = 0
    bad_steps: int = 0
    elapsed_s: float = 0.0
    """Training wall-clock summed over every resumption (for max_minutes)."""


def _step_dirs(out_dir: Path) -> list[tuple[int, Path]]:
    root = Path(out_dir) / "checkpoints"
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        match = re.fullmatch(r"step-(\d+)", path.name)
        if match and (path / MARKER).is_file() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The highest complete step-N folder, or None. Partial (tmp or unmarked) folders are ignored."""
    found = _step_dirs(Path(out_dir))
    return found[-1][1] if found else None


def save_checkpoint(accelerator, out_dir: str | Path, state: TrainState, keep: int) -> Path:
    """Every rank calls this. Writes step-N atomically and prunes all but the newest `keep`."""
    root = Path(out_dir) / "checkpoints"
    final = root / f"step-{state.step}"
    tmp = root / f".tmp-step-{state.step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover from a crashed save
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # model, optimizer, registered scheduler, per-rank RNG
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        _write_synced(tmp / MARKER, json.dumps({"step": state.step}))
        if final.exists():  # saving the same step twice (e.g. after a resume): replace it
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in _step_dirs(Path(out_dir))[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def load_checkpoint(accelerator, path: Path) -> TrainState:
    """Restore model, optimizer, scheduler and RNG in place; return the loop's counters."""
    accelerator.load_state(str(path))
    return TrainState(**json.loads((path / STATE_FILE).read_text()))
