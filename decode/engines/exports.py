"""Where `make export` puts a run's exports and which files the engines read from there.

    <engines.export_dir, default <distill.out_dir>/export>/
      hf/           the draft as a plain full-vocabulary HF folder (HF assistant_model, vLLM draft_model)
      gguf/         draft-f16.gguf, draft-q8_0.gguf (llama.cpp -md)
      target-gguf/  target-f16.gguf, target-q8_0.gguf (llama.cpp -m)

distill/export/engines.py writes this layout (distill may import decode, never the reverse); the
engines only read files, so a draft exported elsewhere works the same.
"""

from __future__ import annotations

from pathlib import Path

from decode.config import Config
from decode.errors import UserError

EXPORT_FORMATS = {"hf": "hf-full", "gguf": "gguf", "target-gguf": "target-gguf"}
"""Folder under the export folder -> `python -m distill.export --format`."""


class MissingExportError(UserError):
    """An export the engines need is not there."""


def export_dir(cfg: Config) -> Path:
    return Path(cfg.engines.export_dir or Path(cfg.distill.out_dir) / "export")


def draft_hf(cfg: Config) -> Path:
    """The full-vocabulary HF folder of the draft."""
    return _existing(export_dir(cfg) / "hf" / "config.json").parent


def draft_gguf(cfg: Config) -> Path:
    return _existing(export_dir(cfg) / "gguf" / f"draft-{cfg.engines.llamacpp_draft}.gguf")


def target_gguf(cfg: Config) -> Path:
    """The target's GGUF per engines.llamacpp_target: a quant of `make export`'s, the wheel's, or a path."""
    choice = cfg.engines.llamacpp_target
    if choice == "embedded":
        from decode.models import embedded_gguf

        return embedded_gguf()
    if choice in ("f16", "q8_0"):
        return _existing(export_dir(cfg) / "target-gguf" / f"target-{choice}.gguf")
    path = Path(choice)
    if not path.is_file():
        raise UserError(f"engines.llamacpp_target: {choice!r} is not 'f16', 'q8_0', 'embedded' or a GGUF file")
    return path


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise MissingExportError(f"{path} does not exist; run `make export` (with the same CONFIG and ARGS) first")
    return path
