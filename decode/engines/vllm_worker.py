"""One vLLM engine configuration over the prompts, run as a script under the vLLM environment's own
interpreter (`make setup-vllm`), which has vLLM but not this project:

    <vllm python> decode/engines/vllm_worker.py job.json result.json

job.json (written by decode/engines/vllm_engine.py): the target folder, dtype, KV-cache bytes,
max_model_len, the speculative_config (null for plain decoding), enforce_eager, the prompts as token ids with a
sampling seed each, the number of new tokens, the temperatures and top-k/top-p, and for batch > 1 the
serving batch sizes, each with its requests (token ids and a seed each). Every prompt is its own generate call
(batch 1), after one untimed warm-up call. Then, per temperature and serving batch size B, all requests
go through vLLM's engine with at most B in flight: a request joins as soon as one finishes (continuous
batching, as a server under steady load). result.json: per temperature, each prompt's new token ids,
wall-clock seconds and what its call moved vLLM's speculative counters by; per serving batch, each
request's token ids and latency (joining to its last token), the wall-clock for all of them and the counters.

Only the standard library is imported at module level: the project's own tests import the pure
functions below (acceptance_counts) without vLLM installed. vLLM starts its engine core with
spawn, hence the `__main__` guard.
"""

from __future__ import annotations

import json
import sys
import time

# vLLM's Prometheus counters for speculative decoding (get_metrics() drops the `_total` suffix).
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)
WARM_UP_TOKENS = 16
"""Each serving batch size first serves its first `batch` requests this far, untimed: a new batch width's
first steps pay for allocation and kernel choice."""


def spec_counters(metrics) -> dict[str, int]:
    """The speculative counters in a get_metrics() snapshot, summed over engines (absent ones are 0)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0)
    for metric in metrics:
        if metric.name in totals and hasattr(metric, "value"):
            totals[metric.name] += int(metric.value)
    return totals


def acceptance_counts(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What the counters moved by between two snapshots: drafts (verification steps that had draft
    tokens), draft_tokens and accepted."""
    return {"drafts": after[DRAFTS] - before[DRAFTS], "draft_tokens": after[DRAFT_TOKENS] - before[DRAFT_TOKENS],
            "accepted": after[ACCEPTED] - before[ACCEPTED]}


def serve(engine, prompts: list, params: list, batch: int, tag: str, clock=time.perf_counter) -> dict:
    """Every prompt through `engine` (vLLM's LLMEngine: add_request, step, has_unfinished_requests) with at
    most `batch` requests in flight, in order; returns the wall-clock seconds and, per prompt, its token
    ids and latency. `tag` starts every request id (vLLM's outputs carry the ids it was given), so it must
    differ from call to call."""
    queue = list(range(len(prompts)))
    joined, done = {}, {}
    start = clock()
    while queue or engine.has_unfinished_requests():
        while queue and len(joined) - len(done) < batch:
            i = queue.pop(0)
            engine.add_request(f"{tag}{i}", prompts[i], params[i])
            joined[i] = clock()
        for output in engine.step():
            if output.finished:
                i = int(output.request_id.removeprefix(tag))
                done[i] = {"token_ids": list(output.outputs[0].token_ids), "seconds": clock() - joined[i]}
    return {"seconds": clock() - start, "requests": [done[i] for i in range(len(prompts))]}


def run(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    batches = [entry["batch"] for entry in job.get("serving", [])]
    llm = LLM(model=job["model"], tokenizer=job["model"], dtype=job["dtype"], seed=job["seed"],
              max_model_len=job["max_model_len"], kv_cache_memory_bytes=job["kv_cache_memory_bytes"],
              speculative_config=job["speculative_config"], enforce_eager=job.get("enforce_eager", False),
              disable_log_stats=False,  # the speculative counters are only kept with stats on
              **({"max_num_seqs": max(batches)} if batches else {}))
    start_s = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]

    def sampling(temperature: float, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=job["max_new_tokens"], temperature=temperature, top_k=job["top_k"],
                              top_p=job["top_p"], seed=seed)

    llm.generate(prompts[:1], sampling(0.0, 0), use_tqdm=False)  # untimed warm-up: allocation, kernel choice
    by_temperature = {}
    for temperature in job["temperatures"]:
        outputs = []
        for i, prompt in enumerate(prompts):
            before = spec_counters(llm.get_metrics())
            t0 = time.perf_counter()
            (result,) = llm.generate([prompt], sampling(temperature, job["seeds"][i]), use_tqdm=False)
            seconds = time.perf_counter() - t0
            # The engine records its stats every step, so they are complete when generate returns.
            outputs.append({"token_ids": list(result.outputs[0].token_ids), "seconds": seconds,
                            **acceptance_counts(before, spec_counters(llm.get_metrics()))})
        by_temperature[str(temperature)] = outputs
    return {"vllm_version": vllm.__version__, "start_s": start_s, "temperatures": by_temperature,
            "serving": serve_batches(llm, job, sampling, TokensPrompt)}


def serve_batches(llm, job: dict, sampling, TokensPrompt) -> dict:
    """"<temperature>/<batch>" -> serve()'s result for that batch size's requests with the counters it moved."""
    out = {}
    for temperature in job["temperatures"]:
        for entry in job.get("serving", []):
            batch, requests = entry["batch"], [TokensPrompt(prompt_token_ids=ids) for ids in entry["prompts"]]
            warm_up = [sampling(temperature, 0)] * batch
            for params in warm_up:
                params.max_tokens = WARM_UP_TOKENS
            serve(llm.llm_engine, requests[:batch], warm_up, batch, f"warm{batch}-T{temperature}-")
            params = [sampling(temperature, seed) for seed in entry["seeds"]]
            before = spec_counters(llm.get_metrics())
            served = serve(llm.llm_engine, requests, params, batch, f"b{batch}-T{temperature}-")
            out[f"{temperature}/{batch}"] = {**served, **acceptance_counts(before, spec_counters(llm.get_metrics()))}
    return out


if __name__ == "__main__":
    job_path, result_path = sys.argv[1:3]
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(result_path, "w") as f:
        json.dump(result, f)
