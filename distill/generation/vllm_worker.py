"""The vLLM side of generate.engine=vllm; the main side is vllm_engine.py.

vllm_process.py starts this module under the vLLM environment's interpreter. It loads the target
with `vllm.LLM`, then answers each request read from stdin (vllm_wire messages) with one
`LLM.generate` call, writing the completions to its stdout. It imports vLLM, numpy and the standard
library only: the rest of the project needs transformers >= 5.24, which vLLM's environment lacks.

The logprobs are vLLM's public output: with `flat_logprobs=True` each position lists the chosen
token, then the K most likely tokens in rank order, as raw (temperature 1) log-softmax values
(vLLM's default logprobs_mode), the numbers the project engine stores.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from distill.generation import vllm_wire as wire


def prompts(request: dict) -> list[dict]:
    """vLLM token prompts (the TokensPrompt dict): the project's chat template and tokenizer made them.
    Score mode feeds prompt + completion and reads the prompt logprobs."""
    if "score" in request:
        return [{"prompt_token_ids": row["prompt_ids"] + row["completion_ids"]} for row in request["score"]]
    return [{"prompt_token_ids": row["prompt_ids"]} for row in request["generate"]]


def sampling_params(request: dict, SamplingParams) -> list:
    """One vllm.SamplingParams per row. Each generated row has its own seed, so its tokens do not
    depend on the rows batched with it."""
    k = request["teacher_topk"] or None
    # Token ids only (no detokenizing); logprobs as a few flat lists, not one Python object per entry.
    quiet = {"detokenize": False, "flat_logprobs": True}
    if "score" in request:
        # One greedy token per row, thrown away: the answer is the prompt's logprobs.
        return [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, **quiet) for _ in request["score"]]
    s = request["sampling"]
    return [SamplingParams(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], max_tokens=s["max_tokens"],
                           stop_token_ids=s["stop_token_ids"], seed=row["seed"], logprobs=k, **quiet)
            for row in request["generate"]]


def topk_arrays(flat, first: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions first.. of a vllm FlatLogprobs -> (ids int32 [n, k], logprobs float32 [n, k]).
    Each position holds the chosen token, then the top k in rank order (k + 1 entries)."""
    starts = np.asarray(flat.start_indices[first:], dtype=np.int64)
    counts = np.asarray(flat.end_indices[first:], dtype=np.int64) - starts
    if np.any(counts != k + 1):
        raise RuntimeError(f"vLLM returned {sorted(set(counts.tolist()))} logprobs per position; expected "
                           f"the chosen token and the top {k}")
    index = starts[:, None] + 1 + np.arange(k)  # [n, k], skipping the chosen token
    return (np.asarray(flat.token_ids, dtype=np.int32)[index].reshape(-1, k),
            np.asarray(flat.logprobs, dtype=np.float32)[index].reshape(-1, k))


def completion(ids, topk: tuple[np.ndarray, np.ndarray] | None) -> dict:
    return {"ids": wire.pack(np.asarray(ids, dtype=np.int32)),
            "topk_ids": None if topk is None else wire.pack(topk[0]),
            "topk_logprobs": None if topk is None else wire.pack(topk[1])}


def answer(llm, SamplingParams, request: dict) -> dict:
    """One request -> {"completions": [...]}, in row order."""
    k = request["teacher_topk"]
    outputs = llm.generate(prompts(request), sampling_params(request, SamplingParams), use_tqdm=False)
    if "score" in request:
        # Prompt position i holds the distribution that predicted token i: the completion starts after the prompt.
        return {"completions": [
            completion(row["completion_ids"], topk_arrays(out.prompt_logprobs, len(row["prompt_ids"]), k))
            for row, out in zip(request["score"], outputs, strict=True)]}
    completions = []
    for out in outputs:
        sample = out.outputs[0]
        if sample.finish_reason not in ("stop", "length"):  # 'abort': vLLM dropped the request
            raise RuntimeError(f"vLLM ended request {out.request_id} with finish_reason {sample.finish_reason!r}")
        completions.append(completion(sample.token_ids, topk_arrays(sample.logprobs, 0, k) if k else None))
    return {"completions": completions}


def one_line(error: BaseException) -> str:
    """An exception as one line (vLLM's config errors span several)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:600]


def serve(llm, SamplingParams, inbox, outbox) -> None:
    """Answer requests until generate-data closes the pipe; a failed request is reported, then raised."""
    while True:
        try:
            request = wire.receive(inbox)
        except EOFError:
            return
        try:
            reply = answer(llm, SamplingParams, request)
        except Exception as e:
            wire.send(outbox, {"error": one_line(e)})
            raise
        wire.send(outbox, reply)


def exit_with_parent() -> None:
    """A killed generate-data cannot close the pipe while vLLM is busy: leave within a second of
    it instead of finishing the window (vLLM's own processes follow this one)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def main() -> int:
    outbox = os.fdopen(os.dup(1), "wb")  # the channel: the pipe generate-data reads
    os.dup2(2, 1)  # whatever prints from here on (vLLM's logs, its child processes') goes to stderr
    exit_with_parent()
    inbox = sys.stdin.buffer
    settings = wire.receive(inbox)
    try:
        import vllm
    except Exception as e:  # not installed, or a broken install (e.g. CUDA builds of torchvision on CPU)
        wire.send(outbox, {"error": one_line(e), "stage": "import"})
        return 1
    try:
        llm = vllm.LLM(**settings["llm"])
    except Exception as e:  # a target vLLM cannot load, a setting it refuses, not enough memory
        wire.send(outbox, {"error": one_line(e), "stage": "load"})
        return 1
    wire.send(outbox, {"ready": vllm.__version__})
    serve(llm, vllm.SamplingParams, inbox, outbox)
    return 0


if __name__ == "__main__":  # vLLM starts its engine with spawn, which re-imports this module
    sys.exit(main())
