"""Where `make export` puts a run's exports and which files the engines read from there.

    <engines.export_dir, default <distill.out_dir>/export>/
      hf/           a standalone draft as a plain full-vocabulary HF folder (HF assistant_model, vLLM draft_model)
      gguf/         its draft-f16.gguf, draft-q8_0.gguf (llama.cpp -md)
      eagle3/       a feature draft as an EAGLE-3 head (vLLM method eagle3)
      eagle3-gguf/  its draft-f16.gguf, draft-q8_0.gguf (llama.cpp --spec-type draft-eagle3 -md)
      target-gguf/  target-f16.gguf, target-q8_0.gguf (llama.cpp -m)

distill/export/engines.py writes this layout (distill may import decode, never the reverse); the
engines only read files, so a draft exported elsewhere works the same.
"""

from __future__ import annotations

from pathlib import Path

from common.config import Config
from common.errors import UserError


EXPORT_FORMATS = {"hf": "hf-full", "gguf": "gguf", "target-gguf": "target-gguf"}
"""A standalone draft's run: folder under the export folder -> `python -m distill.export --format`."""
FEATURE_EXPORT_FORMATS = {"eagle3": "eagle3", "eagle3-gguf": "eagle3-gguf", "target-gguf": "target-gguf"}
"""The same for a feature draft's run."""


class MissingExportError(UserError):
    """An export the engines need is not there."""


def export_dir(cfg: Config) -> Path:
    return Path(cfg.engines.export_dir or Path(cfg.distill.out_dir) / "export")


def draft_kind(cfg: Config) -> str:
    """'standalone' or 'eagle3': engines.draft, or with 'auto' the kind of draft the export folder holds."""
    if cfg.engines.draft != "auto":
        return cfg.engines.draft
    folder = export_dir(cfg)
    found = [kind for kind, names in (("standalone", ("hf", "gguf")), ("eagle3", ("eagle3", "eagle3-gguf")))
             if any((folder / name).is_dir() for name in names)]
    if len(found) > 1:
        raise UserError(f"{folder} holds exports of a standalone draft (hf/, gguf/) and of a feature draft "
                        "(eagle3/, eagle3-gguf/); choose one with engines.draft=standalone or engines.draft=eagle3")
    return found[0] if found else "standalone"


def draft_hf(cfg: Config) -> Path:
    """The draft's folder for HF and vLLM: the full-vocabulary HF folder, or a feature draft's EAGLE-3 head."""
    name = "eagle3" if draft_kind(cfg) == "eagle3" else "hf"
    return _existing(export_dir(cfg) / name / "config.json").parent


def draft_gguf(cfg: Config) -> Path:
    """The draft's GGUF for llama.cpp (engines.llamacpp_draft picks the quant)."""
    name = "eagle3-gguf" if draft_kind(cfg) == "eagle3" else "gguf"
    return _existing(export_dir(cfg) / name / f"draft-{cfg.engines.llamacpp_draft}.gguf")


def target_gguf(cfg: Config) -> Path:
    """The target's GGUF per engines.llamacpp_target: a quant of `make export`'s, the wheel's, or a path."""
    choice = cfg.engines.llamacpp_target
    if choice == "embedded":
        from common.models import embedded_gguf

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
