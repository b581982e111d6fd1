"""Checkpoints and exports under failure (RELIABILITY 14, 15): a full disk while saving, an
unreadable checkpoint on resume, SIGTERM reaching one of two ranks. Tiny models, CPU."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError

from common.cli import run_cli
from common.models import load_model, load_tokenizer
from distill import train as train_module
from distill.checkpoint import latest_checkpoint
from distill.disk import DiskFullError, reporting_full_disk
from distill.export.hf import export_hf
from tests.test_train import data  # noqa: F401 (a fixture: the scored shards every run here trains on)
from tests.test_train import ENV, NO_EXPORT, PY, ROOT, assert_same_weights, losses, run, weights


pytestmark = pytest.mark.usefixtures("one_thread")

SAVES = ["distill.max_steps=6", "distill.save_every=2", "distill.eval_every=0"]
# What torch's zip writer raises when the disk fills mid-file (seen on a full tmpfs): no errno anywhere.
TORCH_OPAQUE = "[enforce fail at inline_container.cc:672] . unexpected pos 167232 vs 167120"


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """SAVES in one go: what every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("straight")
    run(data, out, *SAVES)
    return out


def free_bytes(n):
    """A stand-in for shutil.disk_usage reporting n bytes free."""
    return lambda path: SimpleNamespace(total=10**9, used=10**9 - n, free=n)


def fail_saving(monkeypatch, folder_name, error):
    """torch.save (accelerate's writer of the optimizer, scheduler and RNG files) writes a few
    bytes and raises `error` when saving into `folder_name`."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if folder_name in str(f):
            Path(f).write_bytes(b"partial")
            raise error
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def train_cli(data, out, *overrides):
    """`python -m distill.train` in-process, through the CLI's error handling."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    run_cli(train_module.main, ["--config", str(ROOT / "configs/tiny.yaml"), f"distill.data_dirs=[{data}]",
                                f"distill.out_dir={out}", "wandb.mode=disabled", NO_EXPORT, *overrides])


# ---------------------------------------------------------------- a full disk
def test_full_disk_is_recognised_from_errno_message_or_free_space(tmp_path, monkeypatch):
    target = tmp_path / "not-yet" / "step-4"  # the free space of the nearest existing folder counts
    monkeypatch.setattr(shutil, "disk_usage", free_bytes(10**8))
    for error in (OSError(errno.ENOSPC, "No space left on device"),
                  SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")):
        with pytest.raises(DiskFullError, match=f"no space left on device while saving {target}"):
            with reporting_full_disk(target):
                raise error
    with pytest.raises(DiskFullError):  # errno on the chain: torch re-raising an OSError as RuntimeError
        with reporting_full_disk(target):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError(TORCH_OPAQUE)
    with pytest.raises(RuntimeError, match="unexpected pos") as other:  # space left: a bug, left as it is
        with reporting_full_disk(target):
            raise RuntimeError(TORCH_OPAQUE)
    assert not isinstance(other.value, DiskFullError)
    monkeypatch.setattr(shutil, "disk_usage", free_bytes(0))
    with pytest.raises(DiskFullError, match=f"while saving {target}"):
        with reporting_full_disk(target):
            raise RuntimeError(TORCH_OPAQUE)


def test_disk_full_mid_checkpoint_is_one_error_line_and_keeps_the_previous(data, tmp_path, monkeypatch, capsys):
    fail_saving(monkeypatch, ".tmp-step-4", OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(SystemExit) as exited:
        train_cli(data, tmp_path, *SAVES)
    assert exited.value.code == 2
    err = capsys.readouterr().err  # after the progress bar: one error line, no traceback
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert f"error: no space left on device while saving {tmp_path / 'checkpoints/step-4'};" in err, err
    assert (tmp_path / "checkpoints/.tmp-step-4/optimizer.bin").read_bytes() == b"partial"
    assert latest_checkpoint(tmp_path).name == "step-2"


def test_torch_opaque_write_error_on_a_full_disk(data, straight, tmp_path, monkeypatch):
    fail_saving(monkeypatch, ".tmp-step-4", RuntimeError(TORCH_OPAQUE))
    monkeypatch.setattr(shutil, "disk_usage", free_bytes(0))
    with pytest.raises(DiskFullError, match=f"while saving {tmp_path / 'checkpoints/step-4'}"):
        run(data, tmp_path, *SAVES)
    assert latest_checkpoint(tmp_path).name == "step-2"
    monkeypatch.undo()  # space freed: the rerun resumes from step-2 and ends where a straight run does
    run(data, tmp_path, *SAVES)
    assert_same_weights(tmp_path / "checkpoints/step-6", straight / "checkpoints/step-6", atol=0)


def test_disk_full_during_export_keeps_the_previous_folder(tmp_path, monkeypatch):
    import transformers.modeling_utils

    model, tokenizer = load_model("tiny:draft"), load_tokenizer("tiny:draft")
    out = tmp_path / "best"
    export_hf(model, tokenizer, out, {"metrics.json": "{}"})
    before = weights(out)

    def full_disk(tensors, filename, **kwargs):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    with pytest.raises(DiskFullError, match=f"no space left on device while saving {out}"):
        export_hf(model, tokenizer, out, {"metrics.json": "{}"})
    after = weights(out)
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------- an unreadable checkpoint
def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("broken", ["model.safetensors", "optimizer.bin"])
def test_resume_falls_back_past_an_unreadable_checkpoint(data, straight, tmp_path, broken):
    run(data, tmp_path, *SAVES, "distill.stop_after=4")
    newest = tmp_path / "checkpoints/step-4"
    truncate(newest / broken)  # still marked COMPLETE
    with pytest.warns(UserWarning, match=f"cannot resume from {newest}: .*; trying an older checkpoint"):
        summary = run(data, tmp_path, *SAVES)
    assert summary["step"] == 6
    assert_same_weights(tmp_path / "checkpoints/step-6", straight / "checkpoints/step-6", atol=0)
    assert losses(tmp_path) == losses(straight)


def test_resume_starts_fresh_when_no_checkpoint_loads(data, straight, tmp_path):
    # The model loads before the optimizer fails: the half-loaded step-2 weights must not survive.
    run(data, tmp_path, *SAVES, "distill.stop_after=2", "distill.keep_checkpoints=1")
    only = tmp_path / "checkpoints/step-2"
    truncate(only / "optimizer.bin")
    with pytest.warns(UserWarning, match=f"cannot resume from {only}: .*; starting from scratch"):
        run(data, tmp_path, *SAVES)
    assert_same_weights(tmp_path / "checkpoints/step-6", straight / "checkpoints/step-6", atol=0)
    assert losses(tmp_path) == losses(straight)


# ---------------------------------------------------------------- SIGTERM with two ranks
def torchrun_popen(*args):
    cmd = [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "distill.train",
           "--config", "configs/tiny.yaml", "wandb.mode=disabled", "distill.eval_every=0", "distill.save_every=0",
           NO_EXPORT, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def worker_pid(parent: int, rank: int) -> int:
    """The pid of torchrun `parent`'s worker process of `rank` (from /proc: no psutil needed)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # a process that ended meanwhile
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(stat.parent.name)
    raise LookupError(f"no rank-{rank} worker under pid {parent}")


@pytest.mark.parametrize("receiver", ["rank 1", "torchrun"])
def test_sigterm_with_two_ranks_saves_together_and_resumes(data, tmp_path, receiver):
    """SIGTERM to one worker (a signal reaching one process) or to torchrun (which forwards it to
    every worker): both ranks stop at the same step boundary, save one checkpoint and exit cleanly."""
    proc = torchrun_popen(f"distill.data_dirs=[{data}]", f"distill.out_dir={tmp_path}", "distill.max_steps=100000")
    metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    os.kill(worker_pid(proc.pid, 1) if receiver == "rank 1" else proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert "interrupted; checkpoint saved" in output, output[-3000:]
    # No worker failed (torchrun names a failed child); torchrun itself exits 1 for a signal it received.
    assert not re.search(r"\[rank\d\]: Traceback", output) and "ChildFailedError" not in output, output[-3000:]
    assert proc.returncode == (0 if receiver == "rank 1" else 1), output[-3000:]
    ckpt = latest_checkpoint(tmp_path)
    step = json.loads((ckpt / "train_state.json").read_text())["step"]
    assert ckpt.name == f"step-{step}" and max(losses(tmp_path)) == step
    assert (ckpt / "random_states_0.pkl").exists() and (ckpt / "random_states_1.pkl").exists()
    if receiver == "rank 1":  # the same checkpoint either way: one rerun (10 s) shows it resumes
        rerun = torchrun_popen(f"distill.data_dirs=[{data}]", f"distill.out_dir={tmp_path}",
                               f"distill.max_steps={step + 1}")
        output, _ = rerun.communicate(timeout=120)
        assert rerun.returncode == 0 and f"resumed from {ckpt} (step {step}" in output, output[-3000:]
        assert json.loads((tmp_path / "final_metrics.json").read_text())["step"] == step + 1
