"""Export the draft of a finished run folder (runs/<name>/) to a chosen format."""

from __future__ import annotations

from pathlib import Path

from decode.errors import UserError
from distill.export.hf import export_hf

FORMATS = {"hf": export_hf}
"""format name -> writer(model, tokenizer, out, extra_files)."""
# The run's own records, carried into every export so it says what made it.
RUN_FILES = ("config.yaml", "metrics.json")


def export_run(run_dir: str | Path, out: str | Path, fmt: str = "hf", source: str = "final") -> Path:
    """Load the draft a run exported to <run_dir>/<source> (final/ or best/) and write it to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; known: {sorted(FORMATS)}")
    folder = Path(run_dir) / source
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} holds no exported draft; is {run_dir} a finished `make distill` run?")
    if Path(out).resolve() == folder.resolve():
        raise UserError(f"--out is the source folder {folder}; export to another folder")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    extra = {name: (folder / name).read_text() for name in RUN_FILES if (folder / name).is_file()}
    return FORMATS[fmt](model, tokenizer, out, extra)
