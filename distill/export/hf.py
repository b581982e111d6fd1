"""The Hugging Face folder format: loadable with AutoModelForCausalLM / AutoTokenizer.

A folder is complete or absent: it is written under a hidden temp name next to its place and
renamed into place (replacing the old one) once everything is in it. A full disk raises
DiskFullError (distill/disk.py) naming the folder, and the old one stays in place.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

from safetensors.torch import save_file

from common.outside_factors import FACTORS_NAME, OUTSIDE_FILE
from distill.disk import reporting_full_disk


def export_hf(model, tokenizer, path: str | Path, extra_files: dict[str, str] | None = None,
              state_dict: dict | None = None) -> Path:
    """Write `model` (peft LoRA adapters merged into a copy: the live model keeps training),
    `tokenizer` and `extra_files` (name -> text) as an HF folder at `path`.

    state_dict: the full weights when `model` holds only a shard of them (ZeRO-3/FSDP, gathered by
    the caller); None saves the model's own. A subset draft's config already carries its subset."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with reporting_full_disk(path):
        if hasattr(model, "merge_and_unload"):
            copy.deepcopy(model).merge_and_unload().save_pretrained(tmp)
        else:
            _save_model(model, tmp, state_dict)
        tokenizer.save_pretrained(tmp)
        _add_files(tmp, extra_files or {})
    _replace_dir(tmp, path)
    return path


def _save_model(model, folder: Path, state_dict: dict | None) -> None:
    """save_pretrained, with a factored draft's outside factors in a file of their own (decode/vocab.py),
    so that HF tools find in model.safetensors exactly the weights of the model class its config names."""
    state = dict(model.state_dict() if state_dict is None else state_dict)
    factors = state.pop(FACTORS_NAME, None)
    model.save_pretrained(folder, state_dict=state)
    if factors is not None:
        save_file({FACTORS_NAME: factors.detach().contiguous()}, folder / OUTSIDE_FILE)


def copy_hf(src: Path, dst: Path, extra_files: dict[str, str]) -> Path:
    """An HF folder copied from another (final/ from best/), with files added or replaced."""
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    with reporting_full_disk(dst):
        shutil.copytree(src, tmp)
        _add_files(tmp, extra_files)
    _replace_dir(tmp, dst)
    return dst


def _add_files(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).write_text(text)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move a finished folder into place (the old one, if any, is removed first)."""
    if dst.exists():
        shutil.rmtree(dst)
    src.rename(dst)
