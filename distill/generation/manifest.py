"""manifest.json: what a generate-data folder holds and what made it, written last, atomically.

`complete` is true only when every planned shard is on disk; `verify_shards` (shards.py) refuses
anything else before training reads the data.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import time
from pathlib import Path

import torch

from common.config import Config, config_to_dict
from common.precision import DtypeChoice
from common.prompts import PromptSet
from common.provenance import git_revision
from distill.generation.plan import Row, skipped_by_reason
from distill.generation.shards import check_shard_readable, sha256_file, shard_name


def _versions() -> dict:
    """Installed versions for the manifest, read from package metadata (None if absent): a
    version lookup must never fail a finished run."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__,
            **{name: version(name) for name in ("transformers", "datasets", "pyarrow")}}


def write_manifest(out_dir: Path, config: Config, fingerprint: dict, prompt_set: PromptSet,
                   shards: list[list[Row]], throughput: list[dict], dtype: DtypeChoice) -> dict:
    """Every shard on disk (row count checked, sha256) + the run's provenance; throughput: one dict
    per rank (tokens, seconds, shards) for this run only, computed in `dtype` on the machine it names."""
    listed = []
    for index, shard in enumerate(shards):
        path = out_dir / shard_name(index)
        if path.is_file():
            listed.append({"name": path.name, "rows": check_shard_readable(path, len(shard)),
                           "sha256": sha256_file(path)})
    tokens = sum(t["tokens"] for t in throughput)
    seconds = max((t["seconds"] for t in throughput), default=0.0)
    manifest = {
        "complete": len(listed) == len(shards), "planned_shards": len(shards),
        "rows": sum(s["rows"] for s in listed), "shards": listed,
        "fingerprint": fingerprint, "tokenizer": config.target,
        "prompts": {"kept": len(prompt_set.prompts), "by_source": prompt_set.counts,
                    "skipped_by_reason": skipped_by_reason(prompt_set), "skipped": prompt_set.skipped,
                    "split_counts": prompt_set.split_counts()},
        "throughput_this_run": {"tokens": tokens, "seconds": round(seconds, 2),
                                "tokens_per_s": round(tokens / seconds, 1) if seconds else None, "ranks": throughput,
                                "compute": dtype.as_record()},
        "versions": _versions(), "git_sha": git_revision(), "config": config_to_dict(config),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = out_dir / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out_dir / "manifest.json")
    return manifest
