"""The generation plan: which rows go to which shard, and the fingerprint a resume must match.

Rows are (prompt, sample_index) pairs sorted by prompt length, so each shard (and each batch in
it) holds prompts of similar length: little padding work. Shards are cut from that list in
order and given to ranks round-robin (shard i -> rank i % world_size). The plan depends only on
the config and the prompts, never on the world size or batch size, so a run can be resumed with
another number of processes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from decode.prompts import Prompt

PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class Row:
    prompt: Prompt
    sample_index: int
    completion_ids: tuple[int, ...] = ()
    """Score mode: the tokens the target is teacher-forced over."""


def plan_shards(rows: list[Row], shard_size: int) -> list[list[Row]]:
    ordered = sorted(rows, key=lambda r: (len(r.prompt.token_ids) + len(r.completion_ids),
                                          r.prompt.prompt_id, r.sample_index))
    return [ordered[i:i + shard_size] for i in range(0, len(ordered), shard_size)]


def plan_hash(shards: list[list[Row]]) -> str:
    digest = hashlib.sha256()
    for i, shard in enumerate(shards):
        digest.update(f"[{i}]".encode())
        for row in shard:
            digest.update(f"{row.prompt.prompt_id}:{row.sample_index};".encode())
    return digest.hexdigest()


class ResumeMismatch(ValueError):
    """out_dir holds a run started with different settings; mixing them would corrupt the data."""


def check_or_write_plan(out_dir: Path, fingerprint: dict, write: bool) -> None:
    """First run: record the fingerprint. Later runs: refuse to continue if anything differs."""
    path = out_dir / PLAN_FILE
    if not path.is_file():
        if write:
            tmp = path.with_name(f".{PLAN_FILE}.tmp")
            tmp.write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
            tmp.replace(path)
        return
    recorded = json.loads(path.read_text())
    differs = [f"{key}: {recorded.get(key)!r} -> {fingerprint.get(key)!r}"
               for key in sorted(set(recorded) | set(fingerprint)) if recorded.get(key) != fingerprint.get(key)]
    if differs:
        raise ResumeMismatch(
            f"refusing to resume in {out_dir}: it was started with different settings:\n  "
            + "\n  ".join(differs)
            + "\nUse another generate.out_dir, or delete the folder to start over.")
