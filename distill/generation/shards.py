"""Parquet shards of generate-data: the row schema, atomic writes, and integrity checks.

A shard on disk is complete: it is written to a hidden temp name and renamed into place, so a
kill -9 leaves at worst a temp file, which the next run deletes. manifest.json records each
shard's row count and sha256, which `verify_shards` checks before anything trains on them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError


SCHEMA = pa.schema([
    ("prompt_id", pa.string()),
    ("source", pa.string()),
    ("split", pa.string()),            # 'train' | 'eval'
    ("mode", pa.string()),             # 'generate' | 'score'
    ("sample_index", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("completion_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()),    # 'eos' | 'length'
])
TOPK_FIELDS = [("teacher_topk_ids", pa.list_(pa.list_(pa.int32()))),          # [n_completion, K]
               ("teacher_topk_logprobs", pa.list_(pa.list_(pa.float32())))]  # [n_completion, K]


class CorruptShardError(UserError):
    """A shard is missing, unreadable, or differs from what the manifest recorded."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def _nested(rows: list[np.ndarray], inner: int | None, dtype) -> pa.Array:
    """Ragged rows ([n_i] or [n_i, inner]) -> list<...> array without a Python loop per element."""
    lengths = np.array([len(r) for r in rows], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = np.concatenate([np.asarray(r, dtype=dtype).reshape(-1) for r in rows]) if rows else np.zeros(0, dtype)
    values = pa.array(flat)
    if inner is not None:
        inner_offsets = pa.array(np.arange(0, len(flat) + 1, inner, dtype=np.int32))
        values = pa.ListArray.from_arrays(inner_offsets, values)
    return pa.ListArray.from_arrays(offsets, values)


def rows_to_table(rows: list[dict], teacher_topk: int) -> pa.Table:
    """rows: dicts with the SCHEMA fields (+ teacher_topk_ids/logprobs arrays [n, K] when K > 0)."""
    columns = {
        "prompt_id": pa.array([r["prompt_id"] for r in rows], pa.string()),
        "source": pa.array([r["source"] for r in rows], pa.string()),
        "split": pa.array([r["split"] for r in rows], pa.string()),
        "mode": pa.array([r["mode"] for r in rows], pa.string()),
        "sample_index": pa.array([r["sample_index"] for r in rows], pa.int32()),
        "prompt_ids": _nested([r["prompt_ids"] for r in rows], None, np.int32),
        "completion_ids": _nested([r["completion_ids"] for r in rows], None, np.int32),
        "finish_reason": pa.array([r["finish_reason"] for r in rows], pa.string()),
    }
    schema = SCHEMA
    if teacher_topk:
        columns["teacher_topk_ids"] = _nested([r["teacher_topk_ids"] for r in rows], teacher_topk, np.int32)
        columns["teacher_topk_logprobs"] = _nested([r["teacher_topk_logprobs"] for r in rows], teacher_topk,
                                                   np.float32)
        schema = pa.schema(list(SCHEMA) + [pa.field(n, t) for n, t in TOPK_FIELDS])
    return pa.Table.from_pydict(columns, schema=schema)


def write_shard(table: pa.Table, path: Path) -> None:
    """Write to a hidden temp file in the same folder, fsync, then rename: complete or absent."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def remove_stale_temp(path: Path) -> None:
    """Temp files a killed run left behind for this shard."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        stale.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_shard_readable(path: Path, expected_rows: int | None = None) -> int:
    """Open a shard's Parquet footer; raise CorruptShardError naming it if that fails."""
    try:
        rows = pq.read_metadata(path).num_rows
    except Exception as e:  # pyarrow raises several types for truncated/garbled files
        raise CorruptShardError(f"shard {path} is corrupt or truncated ({e}); delete it and rerun "
                                f"generate-data to regenerate it") from e
    if expected_rows is not None and rows != expected_rows:
        raise CorruptShardError(f"shard {path} has {rows} rows, the plan expects {expected_rows}; "
                                f"delete it and rerun generate-data")
    return rows


def verify_shards(data_dir: str | Path) -> list[Path]:
    """Check every shard manifest.json lists (present, sha256, row count); return their paths.

    Raises CorruptShardError naming the first bad shard, or when the run is incomplete.
    """
    data_dir = Path(data_dir)
    manifest_path = data_dir / "manifest.json"
    if not manifest_path.is_file():
        raise CorruptShardError(f"{data_dir} has no manifest.json: generate-data did not finish there")
    manifest = json.loads(manifest_path.read_text())
    if not manifest.get("complete"):
        raise CorruptShardError(f"{data_dir}: generation is incomplete ({len(manifest['shards'])} of "
                                f"{manifest['planned_shards']} shards); rerun generate-data to finish it")
    paths = []
    for shard in manifest["shards"]:
        path = data_dir / shard["name"]
        if not path.is_file():
            raise CorruptShardError(f"shard {path} listed in the manifest is missing")
        if sha256_file(path) != shard["sha256"]:
            raise CorruptShardError(f"shard {path} does not match the sha256 in manifest.json "
                                    f"(corrupt or modified)")
        check_shard_readable(path, shard["rows"])
        paths.append(path)
    return paths
