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
tmp folder; the previous step-M stays the latest valid checkpoint (a full disk is reported as
DiskFullError, distill/disk.py). A resume takes the newest complete checkpoint that every rank
can load: one whose files cannot be read (truncated behind its marker) is named in a warning and
the one before it is tried; when none loads, the run starts from scratch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from distill.disk import reporting_full_disk

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
    """Every rank calls this. Writes step-N atomically and prunes all but the newest `keep`.
    A full disk raises DiskFullError naming step-N; the earlier checkpoints stay as they were."""
    root = Path(out_dir) / "checkpoints"
    final = root / f"step-{state.step}"
    tmp = root / f".tmp-step-{state.step}"
    with reporting_full_disk(final):  # torch's own error for a full disk says only "unexpected pos"
        _write_tmp(accelerator, tmp, state)
    if accelerator.is_main_process:
        if final.exists():  # saving the same step twice (e.g. after a resume): replace it
            shutil.rmtree(final)
        tmp.rename(final)
        for _, old in _step_dirs(Path(out_dir))[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _write_tmp(accelerator, tmp: Path, state: TrainState) -> None:
    """The whole checkpoint, COMPLETE marker last, into `tmp` (every rank writes its own RNG state)."""
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover from a crashed save
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # model, optimizer, registered scheduler, per-rank RNG
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        _write_synced(tmp / MARKER, json.dumps({"step": state.step}))


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def load_checkpoint(accelerator, path: Path) -> TrainState:
    """Restore model, optimizer, scheduler and RNG in place; return the loop's counters."""
    accelerator.load_state(str(path))
    return TrainState(**json.loads((path / STATE_FILE).read_text()))


def load_newest_loadable(accelerator, out_dir: str | Path) -> tuple[TrainState, Path] | None:
    """Every rank calls this. Restore the newest complete checkpoint that every rank can load,
    warning about each newer one that could not be (a truncated or corrupt file behind its
    COMPLETE marker) and falling back to the one before. A successful load overwrites all the
    state a failed one may have written; None when none loads, and then the model may hold part
    of a failed one (accelerate loads the model before it reads the optimizer): the caller must
    rebuild its state from scratch."""
    newest_first = [path for _, path in reversed(_step_dirs(Path(out_dir)))]
    for i, path in enumerate(newest_first):
        state, error = _try_load(accelerator, path)
        failed = torch.tensor(float(error is not None), device=accelerator.device)
        if accelerator.reduce(failed, "sum") == 0:  # every rank resumes from the same step, or none does
            return state, path
        if error is not None or accelerator.is_main_process:
            reason = _reason(error) if error is not None else "another rank could not load it"
            then = "trying an older checkpoint" if i + 1 < len(newest_first) else "starting from scratch"
            warnings.warn(f"cannot resume from {path}: {reason}; {then}", stacklevel=2)
    return None


def _try_load(accelerator, path: Path) -> tuple[TrainState | None, Exception | None]:
    try:
        return load_checkpoint(accelerator, path), None
    except torch.OutOfMemoryError:
        raise  # a lack of memory, not an unreadable checkpoint: falling back would waste good checkpoints
    except Exception as error:  # noqa: BLE001 (any failure to read a checkpoint means: try the one before)
        return None, error


def _reason(error: Exception) -> str:
    """The error's type and first line, short enough for a warning."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:200]}"
