"""`make export`: the run's draft (and its target) as the files `make eval-engines` and serving engines load.

    python -m distill.export.engines --config configs/smollm2.yaml [key.sub=value ...]

Exports <distill.out_dir>/final/ into the layout of decode/engines/exports.py (by default
<distill.out_dir>/export/: hf/, gguf/ for a standalone draft, eagle3/, eagle3-gguf/ for a feature
draft, and target-gguf/), one `python -m distill.export` format per folder.
"""

from __future__ import annotations

from pathlib import Path

from common.cli import cli_config, run_cli
from decode.drafts.feature.model import is_feature_draft
from decode.engines.exports import EXPORT_FORMATS, FEATURE_EXPORT_FORMATS, export_dir
from distill.export.run import export_run


def main(argv: list[str] | None = None) -> None:
    cfg = cli_config(argv, "Export a run's draft (and its target) for serving engines.")
    out = export_dir(cfg)
    formats = FEATURE_EXPORT_FORMATS if is_feature_draft(Path(cfg.distill.out_dir) / "final") else EXPORT_FORMATS
    for folder, fmt in formats.items():
        print(f"{fmt}: {export_run(cfg.distill.out_dir, out / folder, fmt, target=cfg.target)}")


if __name__ == "__main__":
    run_cli(main)
