"""The parts of `make generate-data` (distill/generate.py is its entry point).

    run.py            the stage: engine choice, plan, resume, this rank's shards, manifest
    plan.py           prompts -> rows -> shards, and the fingerprint a resume must match
    engine.py         the seam: Engine (rows in, completions out), Completion, per-row seeds, EOS ids
    engine_choice.py  generate.engine: project, vllm, or auto
    runner_engine.py  the project's engine: a BatchedRunner, per-row random streams, batching
    batched_loop.py   its token loop: batched sampling and teacher-forced scoring
    vllm_engine.py    the vLLM engine, in generate-data's process: settings, windows of rows
    vllm_process.py   its worker process: environment, start, request/answer, errors
    vllm_worker.py    the worker, under vLLM's own interpreter: vllm.LLM -> completions + top-K
    vllm_wire.py      the messages between the two
    equivalence.py    another engine's top-K against the project engine's, teacher-forced
    shards.py         the Parquet row schema, atomic shard writes, integrity checks
    manifest.py       manifest.json, written last
    ranks.py          one process, or torch.distributed under torchrun
"""
