"""Export the draft of a finished run folder (runs/<name>/) to a chosen format.

Each format writes into a hidden temporary folder next to --out, renamed into place once complete,
with export.json saying which draft and format made it: nothing is ever half-written, and an
existing --out is replaced only when it holds an export of the same draft or the same source folder.
Refused with a one-line UserError: an unknown format, a source folder that is not a complete
draft, a draft whose tokenizer is not the target's, an --out that holds something else, a feature
draft (decode/drafts/feature/model.py) as a standalone draft's format or the other way round.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from common.errors import UserError
from common.models import (EMBEDDED, TOKENIZER_FILES, check_tokenizers, embedded_gguf, load_model, load_tokenizer,
                           model_hash)
from decode.drafts.feature.model import FeatureDraft, check_target, feature_draft_problem, is_feature_draft
from distill.disk import reporting_full_disk
from distill.export.eagle3 import write_eagle3
from distill.export.eagle3_gguf import write_eagle3_gguf
from distill.export.gguf import GGUFExportError, tokenizer_fields, write_gguf_files
from distill.export.hf import export_hf
from distill.export.hf_full import full_vocab_model
from distill.training.feature_target import target_config


# The run's own records, carried into every export so it says what made it.
RUN_FILES = ("config.yaml", "metrics.json")
RECORD = "export.json"


class IncompleteDraftError(UserError):
    """The source folder lacks part of a saved draft."""


class OutputInUseError(UserError):
    """--out already holds something other than an export of this draft."""


@dataclass
class ExportOptions:
    lossy_acceptance: bool = False
    """Export an old subset draft as a full-vocabulary model although its distribution differs."""
    target_gguf: Path | None = None
    """A GGUF of the target, whose tokenizer metadata the GGUF export copies (None: the embedded one)."""


@dataclass
class Draft:
    folder: Path
    model: object
    """The draft as trained (a subset draft's N + 1 rows, or a FeatureDraft), in eval mode."""
    tokenizer: object
    """The draft's own tokenizer (checked equal to the target's); None for a feature draft saved without one."""
    target_tokenizer: object
    target_ref: str
    run_files: dict[str, str]


def write_run_files(draft: Draft, folder: Path) -> None:
    """The run's own records (RUN_FILES) beside an export that has no HF folder of its own to carry them."""
    for name, text in draft.run_files.items():
        (folder / name).write_text(text)


def write_hf(draft: Draft, folder: Path, options: ExportOptions) -> None:
    """The draft's HF folder as training saved it (a subset draft keeps its rows and subset)."""
    export_hf(draft.model, draft.tokenizer, folder, draft.run_files)


def write_hf_full(draft: Draft, folder: Path, options: ExportOptions) -> None:
    """A plain full-vocabulary HF folder with the target's tokenizer files (distill/export/hf_full.py)."""
    export_hf(full_vocab_model(draft.model, options.lossy_acceptance), draft.target_tokenizer, folder,
              draft.run_files)


def write_gguf(draft: Draft, folder: Path, options: ExportOptions) -> None:
    """draft-f16.gguf and draft-q8_0.gguf of the full-vocabulary draft (distill/export/gguf.py)."""
    fields = tokenizer_fields(_target_gguf(draft.target_ref, options.target_gguf))
    model = full_vocab_model(draft.model, options.lossy_acceptance)
    folder.mkdir()
    write_gguf_files(model, fields, folder, "draft")
    write_run_files(draft, folder)


def write_target_gguf(draft: Draft, folder: Path, options: ExportOptions) -> None:
    """target-f16.gguf and target-q8_0.gguf: the run's target itself for llama.cpp's -m, written like the
    draft's files (the embedded target's own GGUF is Q4_1; engines compare better at the same precision)."""
    fields = tokenizer_fields(_target_gguf(draft.target_ref, options.target_gguf))
    folder.mkdir()
    write_gguf_files(load_model(draft.target_ref), fields, folder, "target")


def write_eagle3_format(draft: Draft, folder: Path, options: ExportOptions) -> None:
    """A feature draft as the EAGLE-3 head vLLM and SGLang load (distill/export/eagle3.py)."""
    write_eagle3(draft.model, target_config(draft.target_ref), folder)
    write_run_files(draft, folder)


def write_eagle3_gguf_format(draft: Draft, folder: Path, options: ExportOptions) -> None:
    """A feature draft as llama.cpp's EAGLE-3 draft, f16 and q8_0 (distill/export/eagle3_gguf.py)."""
    fields = tokenizer_fields(_target_gguf(draft.target_ref, options.target_gguf))
    write_eagle3_gguf(draft.model, target_config(draft.target_ref), fields, folder)
    write_run_files(draft, folder)


FORMATS = {"hf": write_hf, "hf-full": write_hf_full, "gguf": write_gguf, "target-gguf": write_target_gguf,
           "eagle3": write_eagle3_format, "eagle3-gguf": write_eagle3_gguf_format}
"""format name -> writer(draft, folder, options); the writer creates `folder`."""
STANDALONE_FORMATS = ("hf", "hf-full", "gguf")
FEATURE_FORMATS = ("eagle3", "eagle3-gguf")
"""The draft formats of each draft kind: a feature draft reads the target's hidden states, so only
EAGLE-3 engines run it."""


def export_run(run_dir: str | Path, out: str | Path, fmt: str = "hf", source: str = "final",
               options: ExportOptions | None = None, target: str | None = None) -> Path:
    """Load the draft a run exported to <run_dir>/<source> (final/ or best/) and write it to `out` as
    `fmt`. target: the target model reference (default: the one in the run's config.yaml)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; known: {sorted(FORMATS)}")
    folder, out = Path(run_dir) / source, Path(out)
    check_complete(folder, Path(run_dir))
    feature = is_feature_draft(folder)
    if fmt in (STANDALONE_FORMATS if feature else FEATURE_FORMATS):
        kind, allowed = ("a feature", FEATURE_FORMATS) if feature else ("a standalone", STANDALONE_FORMATS)
        raise UserError(f"{folder} holds {kind} draft, which exports as {', '.join(allowed)}, not {fmt!r}")
    if out.resolve() == folder.resolve():
        raise UserError(f"--out is the source folder {folder}; export to another folder")
    record = {"format": fmt, "source": str(folder.resolve()), "draft": model_hash(str(folder))}
    check_output_free(out, record)
    draft = load_draft(folder, target)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    made_parent = not out.parent.exists()
    out.parent.mkdir(parents=True, exist_ok=True)  # writers create only their own folder
    try:
        with reporting_full_disk(out):
            FORMATS[fmt](draft, tmp, options or ExportOptions())
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    except Exception:
        if made_parent and not any(out.parent.iterdir()):  # a refusal leaves no empty folder behind
            out.parent.rmdir()
        raise
    shutil.rmtree(out, ignore_errors=True)  # only an export of this draft, or empty (check_output_free)
    tmp.rename(out)
    return out


def check_complete(folder: Path, run_dir: Path) -> None:
    """Refuse a source folder that is not a whole saved draft, naming what is missing."""
    if not folder.is_dir():
        unfinished = folder.with_name(f".tmp-{folder.name}").exists()
        why = "its export did not finish" if unfinished else f"is {run_dir} a finished `make distill` run?"
        raise IncompleteDraftError(f"{folder} does not exist; {why}")
    if is_feature_draft(folder):
        if problem := feature_draft_problem(folder):
            raise IncompleteDraftError(problem)
        return
    missing = [name for name in ("config.json",) if not (folder / name).is_file()]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing += sorted(s for s in shards if not (folder / s).is_file())
    elif not (folder / "model.safetensors").is_file():
        missing.append("model.safetensors")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer files ({', '.join(TOKENIZER_FILES)})")
    if missing:
        raise IncompleteDraftError(f"{folder} is not a complete draft: missing {', '.join(missing)}")


def check_output_free(out: Path, record: dict) -> None:
    """--out may be absent, empty, or an export of the same draft or of the same source folder (a run
    trained further since: its old export is stale), which is replaced; anything else is refused."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputInUseError(f"--out {out} is a file; choose a folder")
    if not any(out.iterdir()):
        return
    previous = _read_record(out / RECORD)
    if previous is None:
        raise OutputInUseError(f"--out {out} already holds files that are not an export; "
                               "choose another folder or remove it")
    if previous.get("draft") != record["draft"] and previous.get("source") != record["source"]:
        raise OutputInUseError(f"--out {out} holds the export of another draft ({previous.get('source')}); "
                               "choose another folder or remove it")


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_draft(folder: Path, target: str | None) -> Draft:
    """The saved draft, its tokenizer and the target's, refused when the two tokenizers differ."""
    from transformers import AutoTokenizer

    run_files = {name: (folder / name).read_text() for name in RUN_FILES if (folder / name).is_file()}
    target_ref = target or _run_target(run_files.get("config.yaml"), folder)
    has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(folder) if has_tokenizer else None
    target_tokenizer = load_tokenizer(target_ref)
    if tokenizer is not None:
        check_tokenizers(target_tokenizer, tokenizer)
    if is_feature_draft(folder):
        model = FeatureDraft.load(folder)
        target = target_config(target_ref)
        check_target(model.config, target, target.vocab_size)
    else:
        model = load_model(str(folder))  # with a factored draft's outside rows (decode/vocab.py)
    return Draft(folder, model, tokenizer, target_tokenizer, target_ref, run_files)


def _run_target(config_text: str | None, folder: Path) -> str:
    """The target reference the run trained against, from its config.yaml."""
    target = (yaml.safe_load(config_text) or {}).get("target") if config_text else None
    if not target:
        raise UserError(f"{folder} has no config.yaml naming the target; pass --target REF")
    return target


def _target_gguf(target_ref: str, given: Path | None) -> Path:
    """The GGUF whose tokenizer metadata the draft's GGUF copies."""
    if given is not None:
        if not Path(given).is_file():
            raise GGUFExportError(f"--target-gguf {given} is not a file")
        return Path(given)
    if target_ref == EMBEDDED or target_ref.startswith("tiny:"):  # tiny models share its tokenizer
        return embedded_gguf()
    raise GGUFExportError(
        f"the GGUF export copies the tokenizer metadata of a GGUF of the target {target_ref!r}, so that "
        "llama.cpp accepts the draft: pass --target-gguf FILE (the file you serve the target from)")
