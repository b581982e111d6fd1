"""The parts of `make generate-data` (distill/generate.py is its entry point).

    plan.py           prompts -> rows -> shards, and the fingerprint a resume must match
    engine.py         the seam: Engine (rows in, completions out) and Completion
    runner_engine.py  the project's engine: a BatchedRunner, per-row random streams, batching
    batched_loop.py   its token loop: batched sampling and teacher-forced scoring
    shards.py         the Parquet row schema, atomic shard writes, integrity checks
    manifest.py       manifest.json, written last
    ranks.py          one process, or torch.distributed under torchrun
"""
