"""Is a generate-data folder's teacher data what the project engine would store? Its top-K logprobs
against the project engine teacher-forced over the same prompts and completions
(distill/generation/equivalence.py).

    .venv/bin/python scripts/check_vllm_equivalence.py data/vllm-smoke/vllm --rows 64

Loads the target of the folder's config.yaml with the project engine at that config's
generate.dtype and generate.backend, scores --rows rows spread over its shards, prints mean KL
(nats per token, over the stored top-K renormalised), top-1 agreement and the top-1 logprob's mean
|difference|, and exits 1 when they are outside --max-kl / --min-top1 (default: the bf16 tolerance).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
import yaml

from common.cli import run_cli
from common.config import Config, load_config
from common.errors import UserError
from distill.generation.run import load_runner
from distill.generation.equivalence import BF16_MAX_MEAN_KL, BF16_MIN_TOP1_AGREEMENT, compare_rows


COLUMNS = ["prompt_ids", "completion_ids", "teacher_topk_ids", "teacher_topk_logprobs"]


def sample_rows(data_dir: Path, count: int) -> list[dict]:
    """`count` rows spread evenly over the folder's shards (they are sorted by length)."""
    rows = [row for path in sorted(data_dir.glob("shard-*.parquet"))
            for row in pq.read_table(path, columns=COLUMNS).to_pylist()]
    if not rows:
        raise UserError(f"{data_dir} has no shards")
    step = max(1, len(rows) // count)
    return rows[::step][:count]


def project_engine_config(data_dir: Path) -> Config:
    """The folder's target and the project engine's settings (generate.dtype, generate.backend), from
    its config.yaml; only these keys, so a folder written before a config key was renamed still loads."""
    path = data_dir / "config.yaml"
    if not path.is_file():
        raise UserError(f"{data_dir} has no config.yaml: not a generate-data folder")
    saved = yaml.safe_load(path.read_text())
    g = saved["generate"]
    if not g.get("teacher_topk"):
        raise UserError(f"{data_dir} stores no teacher top-k (generate.teacher_topk=0)")
    return load_config(None, [f"target={saved['target']}", f"generate.dtype={g['dtype']}",
                              f"generate.backend={g['backend']}"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir", type=Path, help="a generate-data folder (its config.yaml names the target)")
    parser.add_argument("--rows", type=int, default=64, help="rows to score (spread over the shards)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-kl", type=float, default=BF16_MAX_MEAN_KL)
    parser.add_argument("--min-top1", type=float, default=BF16_MIN_TOP1_AGREEMENT)
    args = parser.parse_args(argv)
    config = project_engine_config(args.data_dir)
    _, runner = load_runner(config, torch.device(args.device))
    result = compare_rows(runner, sample_rows(args.data_dir, args.rows))
    print(json.dumps(result))
    within = result["mean_kl"] <= args.max_kl and result["top1_agreement"] >= args.min_top1
    print(f"{'within' if within else 'OUTSIDE'} tolerance (mean KL <= {args.max_kl}, top-1 agreement >= "
          f"{args.min_top1}) against the project engine at generate.dtype={config.generate.dtype}")
    sys.exit(0 if within else 1)


if __name__ == "__main__":
    run_cli(main)
