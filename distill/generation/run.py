"""The generate-data stage (`python -m distill.generate`, make generate-data): engine choice, plan, resume,
this rank's missing shards, manifest.

setup (engine choice, target, engine) -> plan (prompts -> rows -> shards) -> resume check -> this
rank's missing shards through the engine, each written as soon as its rows are back -> manifest.
Each rank (RANK/WORLD_SIZE from torchrun; one plain process otherwise) owns shards i with
i % world_size == rank and writes them atomically; a rerun after a kill finishes only the shards
that are missing. Rank 0 writes manifest.json once every rank has passed the final barrier.
generate.engine picks the project's batched runner or vLLM (a worker process in vLLM's own
environment); both write the same shards. With generate.features the project engine also writes each
shard's features file (a feature draft's stored teacher) right after the shard: in score mode from the
scoring forward, in generate mode from the sampling forwards themselves.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from itertools import chain, islice
from pathlib import Path

import torch

from common.config import Config, ConfigError, config_to_dict, save_config
from common.models import load_model, load_tokenizer, resolve_device
from common.precision import resolve_dtype
from common.progress import BatchProgress
from common.tracking import start_wandb
from decode.drafts.feature.model import is_feature_draft
from decode.runners import make_batched_runner
from distill.feature_store import FeatureSpec, features_dir, load_target, save_features
from distill.generation.engine import Completion, Engine, eos_ids
from distill.generation.engine_choice import choose_engine
from distill.generation.feature_scoring import FeatureScoringEngine, features_spec, fill_missing
from distill.generation.manifest import write_manifest
from distill.generation.plan import Row, check_or_write_plan, fingerprint, plan_rows, plan_shards
from distill.generation.ranks import Ranks
from distill.generation.rollout import check_rollout_draft, feature_rollout_engine, rollout_engine, rollout_record
from distill.generation.runner_engine import RunnerEngine
from distill.generation.shards import check_shard_readable, remove_stale_temp, rows_to_table, sha256_file, shard_name, \
    write_shard
from distill.generation.vllm_engine import VllmEngine


def run(config: Config) -> dict | None:
    """Generate (or score) every missing shard of this rank; rank 0 returns the manifest."""
    config.validate()
    config.check_model_refs("target")
    g = config.generate
    cpu = resolve_device(config.device).type == "cpu"
    choice = choose_engine(config, cpu)
    with ExitStack() as cleanup:
        # vLLM's workers hold the GPUs: the processes around them then talk over gloo, never CUDA.
        ranks = Ranks("cpu" if choice.name == "vllm" else config.device)
        cleanup.callback(ranks.close)
        # 'auto' resolved once, into the config every later step reads (the plan compares the resolved
        # dtype, so a resume of an explicit bf16 run by auto on the same machine is not a changed setting).
        dtype = resolve_dtype(g.dtype, resolve_device(config.device), "generate.dtype")
        config = dataclasses.replace(config, generate=dataclasses.replace(g, dtype=dtype.name))
        g = config.generate
        if ranks.rank == 0:
            print(choice.reason, file=sys.stderr)
            print(dtype.line, file=sys.stderr)
        out_dir = Path(g.out_dir)
        tokenizer = load_tokenizer(config.target)
        if g.features and choice.name == "vllm":
            raise ConfigError(f"generate.features runs on the project engine: {g.out_dir} was started with vLLM")
        spec = features_spec(config, ranks.device, dtype.name) if g.features else None
        if g.rollout_draft is not None:
            check_rollout_draft(config, tokenizer, spec.layers if spec is not None else None)
        if choice.name == "vllm":
            # Not started yet: the plan and resume check come first, and a finished folder never starts vLLM.
            engine = cleanup.enter_context(VllmEngine(config, choice.vllm_version, tokenizer, cpu=cpu))
            context_length = engine.context_length
        elif spec is not None and g.mode == "score":
            model = load_target(config, ranks.device)
            engine = FeatureScoringEngine(model, spec.layers, eos_ids(tokenizer, model.generation_config),
                                          g.batch_size, config.distill.feature_batch_tokens, ranks.device)
            context_length = getattr(model.config, "max_position_embeddings", None)
        elif g.rollout_draft is not None and is_feature_draft(g.rollout_draft):
            engine = feature_rollout_engine(config, ranks.device, tokenizer)
            context_length = engine.context_length
        else:
            model, runner = load_runner(config, ranks.device, spec.layers if spec is not None else ())
            engine = RunnerEngine(runner, eos_ids(tokenizer, model.generation_config), g.batch_size,
                                  g.max_batch_tokens)
            if g.rollout_draft is not None:
                engine = rollout_engine(config, engine, lambda draft: batched_runner(config, draft))
            context_length = getattr(model.config, "max_position_embeddings", None)

        prompt_set, rows = plan_rows(config, tokenizer, context_length)
        shards = plan_shards(rows, g.shard_size)
        run_fingerprint = {**fingerprint(config, tokenizer, shards, choice.name, engine.sampler),
                           **rollout_record(config)}
        if choice.name == "vllm":
            start_vllm(engine, out_dir, run_fingerprint, shards, ranks)
        start_or_resume(out_dir, config, run_fingerprint, ranks)
        todo = missing_shards(out_dir, shards, ranks, g.stop_after_shards)
        if spec is not None:  # after missing_shards: the shards on disk have been checked readable
            start_features(spec, config, engine, out_dir, shards, ranks)

        tracker = start_wandb(config.wandb.mode, config.wandb.project, f"{config.name}-generate", out_dir / "wandb",
                              config_to_dict(config), job_type="generate-data") if ranks.rank == 0 else None
        start = time.perf_counter()
        tokens = write_shards(engine, shards, todo, config, out_dir, ranks, tracker)
        throughput = ranks.gather({"rank": ranks.rank, "tokens": tokens,
                                   "seconds": round(time.perf_counter() - start, 2), "shards": len(todo)})
        ranks.barrier()
        if ranks.rank != 0:
            return None
        manifest = write_manifest(out_dir, config, run_fingerprint, prompt_set, shards, throughput, dtype)
        report(manifest, out_dir, tokens, tracker)
        return manifest


# ----------------------------------------------------------------------------- setup

def load_runner(config: Config, device: torch.device, hidden_layers: list[int] = ()):
    """The target behind a batched runner. The lean runner keeps fp32 weights and residual stream
    and, with generate.dtype bf16 (resolved: never 'auto' here), runs only its GEMMs in bf16; HF
    forwards run wholly in it. hidden_layers: the layers generate.features keeps as it samples."""
    model = load_model(config.target, device=device, dtype=torch.float32)
    return model, batched_runner(config, model, hidden_layers)


def batched_runner(config: Config, model: torch.nn.Module, hidden_layers: list[int] = ()):
    """`model` (the target, or a rollout draft) behind generate.backend's batched runner in generate.dtype."""
    g = config.generate
    matmul_dtype = torch.bfloat16 if g.dtype == "bf16" else None
    try:
        return make_batched_runner(model, g.backend, matmul_dtype, hidden_layers)
    except ValueError as e:  # e.g. backend 'lean' for a model the lean forward does not cover
        raise ConfigError(f"generate.backend {g.backend!r}: {e}") from e


def start_vllm(engine: VllmEngine, out_dir: Path, run_fingerprint: dict, shards: list[list[Row]],
               ranks: Ranks) -> None:
    """Start vLLM (a minute or more, kept out of the tok/s) when this rank has a shard to write, after
    refusing a folder of other settings and before recording this run's: a target vLLM cannot load
    leaves a new folder free for another engine."""
    check_or_write_plan(out_dir, run_fingerprint, write=False)
    if any(ranks.owns(i) and not (out_dir / shard_name(i)).is_file() for i in range(len(shards))):
        engine.start()


def start_or_resume(out_dir: Path, config: Config, run_fingerprint: dict, ranks: Ranks) -> None:
    """Rank 0 records the fingerprint (first run) and the config; every rank then refuses a
    folder started with other settings (ResumeMismatch)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if ranks.rank == 0:
        check_or_write_plan(out_dir, run_fingerprint, write=True)
        save_config(config, out_dir / "config.yaml")
    ranks.barrier()
    check_or_write_plan(out_dir, run_fingerprint, write=False)


def start_features(spec: FeatureSpec, config: Config, engine: Engine, out_dir: Path, shards: list[list[Row]],
                   ranks: Ranks) -> None:
    """generate.features: rank 0 records what the folder's features are for, then every rank gives its shards
    already on disk the features file they lack, as `make features` would (the scoring engine's own target; in
    generate mode the target loaded as `make features` loads it, only when a file is missing)."""
    if ranks.rank == 0:
        spec.write(features_dir(out_dir))
    ranks.barrier()
    def target():
        return engine.target if isinstance(engine, FeatureScoringEngine) else load_target(config, ranks.device)

    fill_missing(target, spec, out_dir, {i: len(rows) for i, rows in enumerate(shards) if ranks.owns(i)},
                 (config.generate.batch_size, config.distill.feature_batch_tokens), ranks.device)


def missing_shards(out_dir: Path, shards: list[list[Row]], ranks: Ranks, stop_after: int) -> list[int]:
    """This rank's shards not on disk yet (at most stop_after of them when > 0). A killed write's
    temp file is removed; a shard on disk must open with the planned row count (CorruptShardError)."""
    todo = []
    for i in filter(ranks.owns, range(len(shards))):
        path = out_dir / shard_name(i)
        remove_stale_temp(path)
        if path.is_file():
            check_shard_readable(path, len(shards[i]))
        else:
            todo.append(i)
    return todo[:stop_after] if stop_after else todo


# ----------------------------------------------------------------------------- shards

def write_shards(engine: Engine, shards: list[list[Row]], todo: list[int], config: Config, out_dir: Path,
                 ranks: Ranks, tracker) -> int:
    """Each shard in todo: its rows through the engine, then one atomic Parquet write. Returns the
    completion tokens produced."""
    g = config.generate
    rows = [row for i in todo for row in shards[i]]
    progress = BatchProgress(f"{g.mode} rank 0/{ranks.world}", len(rows), "rows", enabled=ranks.rank == 0,
                             total_tokens=sum(len(row.completion_ids) for row in rows))  # 0 in generate mode
    # One engine call over every row to do, so an engine may batch across shards (vLLM keeps its
    # batch full); each shard is written as soon as its rows are back.
    stream = chain.from_iterable(counted(completions(engine, rows, config), progress))
    for i in todo:
        shard_start, records, hidden = time.perf_counter(), [], []
        for row, completion in zip(shards[i], islice(stream, len(shards[i])), strict=True):
            records.append(shard_record(row, g.mode, completion))
            hidden.append(completion.hidden)
        path = out_dir / shard_name(i)
        write_shard(rows_to_table(records, g.teacher_topk), path)
        if g.features:  # after the shard: its digest names the shard the states belong to
            save_features(path, (sha256_file(path), len(records)), hidden)
        if tracker is not None:
            shard_tokens = sum(len(r["completion_ids"]) for r in records)
            tracker.log({"shard": i, "tokens": shard_tokens,
                         "tokens_per_s": shard_tokens / (time.perf_counter() - shard_start)})
    progress.close()
    return progress.tokens


def counted(batches: Iterator[list[Completion]], progress: BatchProgress) -> Iterator[list[Completion]]:
    """The engine's batches, each counted (rows, completion tokens) as it arrives."""
    for batch in batches:
        progress.batch_done(len(batch), sum(len(c.completion_ids) for c in batch))
        yield batch


def completions(engine: Engine, rows: list[Row], config: Config):
    g = config.generate
    if g.mode == "score":
        return engine.score(rows, g.teacher_topk)
    return engine.generate(rows, g.sampling, g.max_new_tokens, g.teacher_topk, config.seed)


def shard_record(row: Row, mode: str, completion: Completion) -> dict:
    """One row of a shard (shards.SCHEMA, + the teacher top-k when the engine returned it)."""
    record = {"prompt_id": row.prompt.prompt_id, "source": row.prompt.source, "split": row.prompt.split,
              "mode": mode, "sample_index": row.sample_index, "prompt_ids": list(row.prompt.token_ids),
              "completion_ids": completion.completion_ids, "finish_reason": completion.finish_reason}
    if completion.topk_ids is not None:
        record["teacher_topk_ids"], record["teacher_topk_logprobs"] = completion.topk_ids, completion.topk_logprobs
    return record


def report(manifest: dict, out_dir: Path, tokens: int, tracker) -> None:
    """One summary line on stderr (and the W&B run's summary)."""
    skipped = manifest["prompts"]["skipped_by_reason"]
    tokens_per_s = manifest["throughput_this_run"]["tokens_per_s"]
    print(f"{out_dir}: {len(manifest['shards'])}/{manifest['planned_shards']} shards, {manifest['rows']} rows; "
          f"{manifest['prompts']['kept']} prompts kept, skipped {skipped or 'none'}; "
          f"{tokens} tokens this run at {tokens_per_s} tok/s", file=sys.stderr)
    if tracker is not None:
        tracker.summary.update({"rows": manifest["rows"], "tokens_per_s": tokens_per_s})
        tracker.finish()

