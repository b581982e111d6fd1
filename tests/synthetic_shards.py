"""Small teacher-scored shards in the generate-data format, made directly from a target model.

For the training tests and scripts/bench_distill.py: prompts and completions are random token
sequences drawn from a fixed pool (so a vocabulary subset is meaningful), scored by the target
like `generate.mode=score` does: row j of the teacher cache is the target's top-K log-softmax
(T = 1) for predicting completion token j. The schema, the shard writer and the manifest's
checks are generate-data's own (distill/generation/shards.py). Real data comes from
`make generate-data`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import torch

from distill.generation.shards import rows_to_table, sha256_file, shard_name, write_shard


@torch.no_grad()
def write_scored_shards(out_dir: str | Path, target, *, n_train: int = 24, n_eval: int = 8,
                        prompt_len: tuple[int, int] = (3, 10), completion_len: tuple[int, int] = (4, 12),
                        topk: int = 8, pool: tuple[int, int] = (300, 700), eos_id: int = 2,
                        rows_per_shard: int = 16, seed: int = 0) -> Path:
    """Write ceil((n_train + n_eval) / rows_per_shard) shards + manifest.json; returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int, size=()) -> torch.Tensor:
        return torch.randint(lo, hi + 1, size, generator=generator)

    rows = []
    for i in range(n_train + n_eval):
        prompt = randint(pool[0], pool[1], (int(randint(*prompt_len)),)).tolist()
        completion = randint(pool[0], pool[1], (int(randint(*completion_len)),)).tolist()
        if i % 3 == 0:
            completion[-1] = eos_id  # some completions end with EOS, as generated ones do
        ids = torch.tensor(prompt + completion)[None]
        logp = torch.log_softmax(target(input_ids=ids).logits[0].float(), -1)  # [L, V]
        rows_logp = logp[len(prompt) - 1: len(prompt) + len(completion) - 1]  # predicts each completion token
        top = rows_logp.topk(topk, dim=-1)  # sorted descending
        rows.append(dict(prompt_id=f"p{i}", source="synthetic", split="train" if i < n_train else "eval",
                         mode="score", sample_index=0, prompt_ids=prompt, completion_ids=completion,
                         finish_reason="eos" if completion[-1] == eos_id else "length",
                         teacher_topk_ids=top.indices.numpy(), teacher_topk_logprobs=top.values.numpy()))
    for start in range(0, len(rows), rows_per_shard):
        write_shard(rows_to_table(rows[start:start + rows_per_shard], topk), out_dir / shard_name(start // rows_per_shard))
    write_manifest(out_dir, teacher_topk=topk, synthetic=True)
    return out_dir


def write_manifest(data_dir: Path, **fields) -> None:
    """A complete manifest.json listing every *.parquet in data_dir (sha256, rows): the fields
    generate-data's verify_shards checks. Tests that edit shards on purpose call it again after."""
    shards = [{"name": p.name, "rows": pq.read_metadata(p).num_rows, "sha256": sha256_file(p)}
              for p in sorted(data_dir.glob("*.parquet"))]
    manifest = {"complete": True, "planned_shards": len(shards), "shards": shards, **fields}
    (data_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
