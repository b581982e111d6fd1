"""A stand-in for vLLM's public API (`LLM`, `SamplingParams`) for tests without vLLM.

Put this folder on PYTHONPATH and generate-data's worker imports it as `vllm`
(vllm_fake-0.0.0.dist-info makes it look installed). Its "target" is a fixed function of the
token prefix, so generated and teacher-forced logprobs agree; a row's tokens depend only on its
seed, as vLLM's per-request generators make them. Switches (environment variables):
FAKE_VLLM_RECORD (file: each LLM's keyword arguments are appended as a JSON line),
FAKE_VLLM_FAIL_LOAD (LLM(...) raises), FAKE_VLLM_BROKEN_IMPORT (importing this raises),
FAKE_VLLM_SECONDS_PER_CALL (each generate call sleeps that long).
"""

import json
import os
import time
from types import SimpleNamespace

import numpy as np

if os.environ.get("FAKE_VLLM_BROKEN_IMPORT"):
    raise ImportError("operator torchvision::nms does not exist")

__version__ = "0.0.0+fake"
VOCAB = 997  # a prime, so the K ids below are distinct for any K < VOCAB


def fake_topk(prefix: list[int], k: int) -> tuple[list[int], list[float]]:
    """The fake target's k most likely next tokens after `prefix`, best first, and their logprobs."""
    base = (sum(prefix) * 31 + len(prefix)) % VOCAB
    return [3 + (base + 7 * j) % VOCAB for j in range(k)], [-0.5 - j for j in range(k)]


class FlatLogprobs:
    """vLLM's flat layout: per position, the chosen token then the top k, in shared lists."""

    def __init__(self):
        self.start_indices, self.end_indices, self.token_ids, self.logprobs = [], [], [], []

    def append(self, ids: list[int], logprobs: list[float]) -> None:
        self.start_indices.append(len(self.token_ids))
        self.token_ids += ids
        self.logprobs += logprobs
        self.end_indices.append(len(self.token_ids))


class SamplingParams:
    def __init__(self, temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, stop_token_ids=None, seed=None,
                 logprobs=None, prompt_logprobs=None, detokenize=True, flat_logprobs=False):
        self.__dict__.update(locals())
        del self.__dict__["self"]


class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_RECORD"):
            with open(os.environ["FAKE_VLLM_RECORD"], "a") as fh:
                fh.write(json.dumps(kwargs) + "\n")
        if os.environ.get("FAKE_VLLM_FAIL_LOAD"):
            raise ValueError(f"fake vLLM cannot load {kwargs['model']}:\n  unsupported architecture")
        self.kwargs = kwargs

    def generate(self, prompts, params, use_tqdm=True):
        time.sleep(float(os.environ.get("FAKE_VLLM_SECONDS_PER_CALL", "0")))
        return [self._one(str(i), p["prompt_token_ids"], s) for i, (p, s) in enumerate(zip(prompts, params))]

    def _one(self, request_id: str, prompt: list[int], params: SamplingParams):
        assert params.flat_logprobs and not params.detokenize
        if params.prompt_logprobs:
            scored = FlatLogprobs()
            scored.append([], [])  # the first prompt token has no prediction
            for i in range(1, len(prompt)):
                ids, logprobs = fake_topk(prompt[:i], params.prompt_logprobs)
                scored.append([prompt[i]] + ids, [-1.0] + logprobs)
            sample = SimpleNamespace(token_ids=[prompt[-1]], finish_reason="length", logprobs=None)
            return SimpleNamespace(request_id=request_id, outputs=[sample], prompt_logprobs=scored)
        rng = np.random.default_rng(params.seed)
        k = params.logprobs or 4
        tokens, flat, finish = [], FlatLogprobs(), "length"
        for _ in range(params.max_tokens):
            ids, logprobs = fake_topk(prompt + tokens, k)
            token = params.stop_token_ids[0] if rng.random() < 0.1 else ids[int(rng.integers(k))]
            flat.append([token] + ids, [-1.0] + logprobs)
            tokens.append(token)
            if token in params.stop_token_ids:
                finish = "stop"
                break
        sample = SimpleNamespace(token_ids=tokens, finish_reason=finish, logprobs=flat if params.logprobs else None)
        return SimpleNamespace(request_id=request_id, outputs=[sample], prompt_logprobs=None)
