"""`make generate-data`: sample target completions (or score text) into Parquet shards + manifest.

    python -m distill.generate --config configs/tiny.yaml generate.out_dir=data/x
    torchrun --standalone --nproc_per_node 2 -m distill.generate --config configs/smollm2.yaml

setup (config, prompts, plan, resume check) -> loop over this rank's missing shards -> manifest.
Each rank (RANK/WORLD_SIZE from torchrun; one plain process otherwise) owns shards i with
i % world_size == rank and writes them atomically; a rerun after a kill finishes only the shards
that are missing. Rank 0 writes manifest.json once every rank has passed the final barrier.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from decode.config import Config, ConfigError, cli_config, config_to_dict, save_config
from decode.tracking import start_wandb
from decode.models import load_model, load_tokenizer, model_hash, resolve_device
from decode.prompts import build_prompt_set, chat_template_hash, tokenizer_hash
from decode.provenance import git_revision
from distill.gen_hf import BatchedHF
from distill.gen_llama import BatchedLlama, lean_supported
from distill.gen_plan import ResumeMismatch, Row, check_or_write_plan, plan_hash, plan_shards
from distill.gen_sampling import generate_batch, row_uniforms, score_batch
from distill.gen_shards import (CorruptShardError, check_shard_readable, remove_stale_temp, rows_to_table, sha256_file, shard_name,
                                write_shard)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- processes

class Ranks:
    """torch.distributed when launched by torchrun (gloo on CPU, nccl on GPU), else one process."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.world > 1:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


# ----------------------------------------------------------------------------- setup

def check_generate_config(config: Config) -> None:
    g = config.generate
    problems = []
    if g.backend not in ("auto", "lean", "hf"):
        problems.append(f"generate.backend: {g.backend!r} is not 'auto', 'lean' or 'hf'")
    if g.dtype not in DTYPES:
        problems.append(f"generate.dtype: {g.dtype!r} is not one of {list(DTYPES)}")
    if g.mode == "score" and g.teacher_topk <= 0:
        problems.append("generate.teacher_topk must be >= 1 in score mode (the top-k is what it stores)")
    if not 0 <= g.eval_fraction < 1:
        problems.append(f"generate.eval_fraction: {g.eval_fraction} is outside [0, 1)")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def load_runner(config: Config, device: torch.device):
    """The target behind a batched runner. The lean runner keeps fp32 weights and residual stream
    and, with dtype bfloat16, runs only its GEMMs in bf16; HF forwards run wholly in `dtype`."""
    g = config.generate
    model = load_model(config.target, device=device, dtype=torch.float32)
    if g.backend == "hf" or (g.backend == "auto" and not lean_supported(model)):
        return model, BatchedHF(model.to(DTYPES[g.dtype]))
    if not lean_supported(model):
        raise ConfigError(f"generate.backend 'lean' does not support {type(model).__name__}")
    return model, BatchedLlama(model, None if g.dtype == "float32" else DTYPES[g.dtype])


def plan_rows(config: Config, tokenizer, context_length: int):
    """Prompts -> (prompt set, rows). Score mode scores the raw text: token 0 is the context."""
    g = config.generate
    score = g.mode == "score"
    prompt_set = build_prompt_set(
        g.sources, tokenizer, text_field=g.text_field, system_prompt=g.system_prompt,
        max_prompt_tokens=g.max_prompt_tokens, max_new_tokens=0 if score else g.max_new_tokens,
        context_length=context_length, eval_fraction=g.eval_fraction, max_prompts=g.max_prompts,
        chat_template=not score)
    if score:
        rows = [Row(dataclasses.replace(p, token_ids=p.token_ids[:1]), 0, p.token_ids[1:])
                for p in prompt_set.prompts if len(p.token_ids) >= 2]
    else:
        rows = [Row(p, s) for p in prompt_set.prompts for s in range(g.samples_per_prompt)]
    return prompt_set, rows


def fingerprint(config: Config, tokenizer, shards) -> dict:
    """Everything that changes what a row contains. Batch size and world size do not."""
    g = config.generate
    return {
        "target": config.target, "target_hash": model_hash(config.target),
        "tokenizer_hash": tokenizer_hash(tokenizer), "chat_template_hash": chat_template_hash(tokenizer),
        "mode": g.mode, "seed": config.seed, "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
        "max_new_tokens": g.max_new_tokens, "samples_per_prompt": g.samples_per_prompt,
        "teacher_topk": g.teacher_topk, "dtype": g.dtype, "system_prompt": g.system_prompt,
        "sources": g.sources, "text_field": g.text_field, "max_prompts": g.max_prompts,
        "max_prompt_tokens": g.max_prompt_tokens, "eval_fraction": g.eval_fraction, "shard_size": g.shard_size,
        "num_shards": len(shards), "plan_hash": plan_hash(shards),
    }


def batches(rows: list[Row], batch_size: int, max_batch_tokens: int, new_tokens: int):
    """Consecutive rows (sorted by length) in batches of <= batch_size rows and <= max_batch_tokens
    cache slots (rows x longest sequence), which bounds KV-cache memory."""
    batch: list[Row] = []
    for row in rows:
        longest = len(row.prompt.token_ids) + len(row.completion_ids) + new_tokens
        if batch and (len(batch) == batch_size or (len(batch) + 1) * longest > max_batch_tokens):
            yield batch
            batch = []
        batch.append(row)
    if batch:
        yield batch


# ----------------------------------------------------------------------------- one shard

def _row_dict(row: Row, mode: str, completion_ids, finish_reason: str, topk=None) -> dict:
    out = {"prompt_id": row.prompt.prompt_id, "source": row.prompt.source, "split": row.prompt.split,
           "mode": mode, "sample_index": row.sample_index, "prompt_ids": list(row.prompt.token_ids),
           "completion_ids": completion_ids, "finish_reason": finish_reason}
    if topk is not None:
        out["teacher_topk_ids"], out["teacher_topk_logprobs"] = topk
    return out


def run_shard(runner, shard: list[Row], config: Config, eos_ids: list[int], on_batch) -> tuple[list[dict], int]:
    """All rows of one shard -> (row dicts in plan order, completion tokens produced)."""
    g = config.generate
    out, tokens = [], 0
    new_tokens = 0 if g.mode == "score" else g.max_new_tokens
    for batch in batches(shard, g.batch_size, g.max_batch_tokens, new_tokens):
        prompts = [list(r.prompt.token_ids) for r in batch]
        if g.mode == "score":
            completions = [list(r.completion_ids) for r in batch]
            for row, completion, topk in zip(batch, completions, score_batch(runner, prompts, completions,
                                                                            g.teacher_topk)):
                finish = "eos" if completion and completion[-1] in eos_ids else "length"
                out.append(_row_dict(row, "score", completion, finish, topk))
            n = sum(map(len, completions))
        else:
            uniforms = torch.stack([row_uniforms(config.seed, r.prompt.prompt_id, r.sample_index, g.max_new_tokens)
                                    for r in batch])  # [B, max_new_tokens]
            results = generate_batch(runner, prompts, uniforms, max_new_tokens=g.max_new_tokens,
                                     temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, eos_ids=eos_ids,
                                     teacher_topk=g.teacher_topk)
            for row, c in zip(batch, results):
                topk = (c.topk_ids, c.topk_logprobs) if g.teacher_topk else None
                out.append(_row_dict(row, "generate", c.completion_ids, c.finish_reason, topk))
            n = sum(len(c.completion_ids) for c in results)
        tokens += n
        on_batch(len(batch), n)
    return out, tokens


# ----------------------------------------------------------------------------- manifest

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


def write_manifest(out_dir: Path, config: Config, print_: dict, prompt_set, shards, throughput: list[dict]) -> dict:
    listed = []
    for index, shard in enumerate(shards):
        path = out_dir / shard_name(index)
        if path.is_file():
            listed.append({"name": path.name, "rows": check_shard_readable(path, len(shard)),
                           "sha256": sha256_file(path)})
    skipped_by_reason: dict[str, int] = {}
    for s in prompt_set.skipped:
        skipped_by_reason[s["reason"]] = skipped_by_reason.get(s["reason"], 0) + 1
    tokens = sum(t["tokens"] for t in throughput)
    seconds = max((t["seconds"] for t in throughput), default=0.0)
    manifest = {
        "complete": len(listed) == len(shards), "planned_shards": len(shards),
        "rows": sum(s["rows"] for s in listed), "shards": listed,
        "fingerprint": print_, "tokenizer": config.target,
        "prompts": {"kept": len(prompt_set.prompts), "by_source": prompt_set.counts,
                    "skipped_by_reason": skipped_by_reason, "skipped": prompt_set.skipped,
                    "split_counts": prompt_set.split_counts()},
        "throughput_this_run": {"tokens": tokens, "seconds": round(seconds, 2),
                                "tokens_per_s": round(tokens / seconds, 1) if seconds else None, "ranks": throughput},
        "versions": _versions(), "git_sha": git_revision(), "config": config_to_dict(config),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = out_dir / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(out_dir / "manifest.json")
    return manifest


# ----------------------------------------------------------------------------- entry point

def run(config: Config) -> dict | None:
    """Generate (or score) every missing shard of this rank; rank 0 returns the manifest."""
    check_generate_config(config)
    g = config.generate
    ranks = Ranks(config.device)
    try:
        out_dir = Path(g.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tokenizer = load_tokenizer(config.target)
        model, runner = load_runner(config, ranks.device)
        context_length = getattr(model.config, "max_position_embeddings", None)
        prompt_set, rows = plan_rows(config, tokenizer, context_length)
        shards = plan_shards(rows, g.shard_size)
        print_ = fingerprint(config, tokenizer, shards)
        if ranks.rank == 0:
            check_or_write_plan(out_dir, print_, write=True)
            save_config(config, out_dir / "config.yaml")
        ranks.barrier()
        check_or_write_plan(out_dir, print_, write=False)  # every rank refuses a mismatch itself

        mine = [i for i in range(len(shards)) if i % ranks.world == ranks.rank]
        todo = []
        for i in mine:
            path = out_dir / shard_name(i)
            remove_stale_temp(path)
            if path.is_file():
                check_shard_readable(path, len(shards[i]))
            else:
                todo.append(i)
        if g.stop_after_shards:
            todo = todo[:g.stop_after_shards]

        eos_ids = sorted({tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id)) - {None})
        tracker = start_wandb(config.wandb.mode, config.wandb.project, f"{config.name}-generate", out_dir / "wandb",
                              config_to_dict(config), job_type="generate-data") if ranks.rank == 0 else None
        bar = tqdm(total=sum(len(shards[i]) for i in todo), unit="row", disable=ranks.rank != 0,
                   desc=f"{g.mode} rank 0/{ranks.world}", dynamic_ncols=True)
        tokens, start = 0, time.perf_counter()

        def on_batch(n_rows: int, n_tokens: int) -> None:
            nonlocal tokens
            tokens += n_tokens
            bar.update(n_rows)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")

        for i in todo:
            shard_start = time.perf_counter()
            shard_rows, shard_tokens = run_shard(runner, shards[i], config, eos_ids, on_batch)
            write_shard(rows_to_table(shard_rows, g.teacher_topk), out_dir / shard_name(i))
            if tracker is not None:
                tracker.log({"shard": i, "tokens": shard_tokens,
                             "tokens_per_s": shard_tokens / (time.perf_counter() - shard_start)})
        bar.close()
        seconds = time.perf_counter() - start
        stats = ranks.gather({"rank": ranks.rank, "tokens": tokens, "seconds": round(seconds, 2),
                              "shards": len(todo)})
        ranks.barrier()
        manifest = None
        if ranks.rank == 0:
            manifest = write_manifest(out_dir, config, print_, prompt_set, shards, stats)
            skipped = manifest["prompts"]["skipped_by_reason"]
            print(f"{out_dir}: {len(manifest['shards'])}/{len(shards)} shards, {manifest['rows']} rows; "
                  f"{manifest['prompts']['kept']} prompts kept, skipped {skipped or 'none'}; "
                  f"{tokens} tokens this run at {manifest['throughput_this_run']['tokens_per_s']} tok/s",
                  file=sys.stderr)
            if tracker is not None:
                tracker.summary.update({"rows": manifest["rows"], "tokens_per_s":
                                        manifest["throughput_this_run"]["tokens_per_s"]})
                tracker.finish()
        return manifest
    finally:
        ranks.close()


def _as_list(value) -> list:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def main(argv: list[str] | None = None) -> None:
    config = cli_config(argv, "Sample target completions (or score text) into Parquet shards + manifest.json.")
    try:
        run(config)
    except (ConfigError, ResumeMismatch, CorruptShardError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
