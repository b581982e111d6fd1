"""The serving engines' files of a finished run, written at the end of `make distill` (distill.export).

A feature draft becomes the EAGLE-3 head vLLM and SGLang load (export/eagle3/) and llama.cpp's
EAGLE-3 GGUF files (export/eagle3-gguf/). A standalone draft
that exports exactly (a full-vocabulary draft, or a subset draft trained with distill.spread_other)
becomes the folders `make eval-engines` reads (decode/engines/exports.py): export/hf/ (hf-full) and
export/gguf/ (llama.cpp). The target's own GGUF (`make export`'s target-gguf, hundreds of MB) is left
to `make export`. A subset draft without spread_other is not exported: an engine would run a
different distribution and accept less often; one line says so and what to do.

Training's work is saved in final/ before this runs, and a failed export never touches it: every
problem becomes a line of the run's output instead of an error.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from common.errors import UserError
from decode.drafts.feature.model import is_feature_draft
from decode.engines.exports import EXPORT_FORMATS, FEATURE_EXPORT_FORMATS, export_dir
from decode.vocab import VocabSubset
from distill.export.hf_full import exports_exactly
from distill.export.run import export_run


FEATURE_FOLDERS = {folder: fmt for folder, fmt in FEATURE_EXPORT_FORMATS.items() if fmt != "target-gguf"}
"""Folder under the export folder -> format, for a feature draft: the draft's own formats of `make export`."""
STANDALONE_FOLDERS = {folder: fmt for folder, fmt in EXPORT_FORMATS.items() if fmt != "target-gguf"}
"""The same for a standalone draft."""


def export_for_serving(cfg) -> list[str]:
    """Export <distill.out_dir>/final for serving engines; one line per format, written or skipped."""
    run = Path(cfg.distill.out_dir)
    feature = is_feature_draft(run / "final")
    if not feature and not exports_exactly(VocabSubset.from_config(AutoConfig.from_pretrained(run / "final"))):
        return [f"export skipped: this vocabulary-subset draft was trained without distill.spread_other, so as "
                f"a full-vocabulary model an engine would accept its tokens less often; train with "
                f"distill.spread_other=true to export it exactly, or run `python -m distill.export --run {run} "
                f"--format hf-full --lossy-acceptance`"]
    out, lines = export_dir(cfg), []
    for folder, fmt in (FEATURE_FOLDERS if feature else STANDALONE_FOLDERS).items():
        try:
            lines.append(f"export {fmt}: {export_run(run, out / folder, fmt, target=cfg.target)}")
        except UserError as err:
            lines.append(f"export {fmt} skipped: {err}")
    return lines
