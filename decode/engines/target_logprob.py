"""How likely the target finds each engine's output: the mean log-probability per token, under the
target at the temperature the output was sampled at (T = 1 for greedy).

Greedy outputs are checked token by token against plain decoding; sampled ones cannot be. This is
their check: a lossless speculative sampler draws from the target's own distribution, so its samples
score like plain decoding's (within sampling noise), while a broken one scores far lower. Text
outputs (llama.cpp) are re-tokenized, which may split a few tokens differently: fine for this check.
"""

from __future__ import annotations

import torch

from common.models import load_model, resolve_device, torch_dtype
from decode.engines.job import EngineJob
from decode.engines.rows import EngineRun


@torch.inference_mode()
def score_runs(runs: list[EngineRun], job: EngineJob) -> None:
    """Set every run's target_logprob (the mean over all its prompts' tokens)."""
    cfg = job.cfg
    device = resolve_device(cfg.device)
    target = load_model(cfg.target, device, torch_dtype(cfg.eval.dtype, device))
    for run in runs:
        prompts = job.requests(run.batch) if run.batch > 1 else job.prompt_sets[run.prompt_set]
        total, count = 0.0, 0
        for prompt_ids, output in zip(prompts, run.outputs, strict=True):
            ids = job.tokenizer.encode(output, add_special_tokens=False) if isinstance(output, str) else output
            if ids:
                total += token_logprobs(target, prompt_ids, ids, run.temperature or 1.0).sum().item()
                count += len(ids)
        run.target_logprob = total / count if count else None


def token_logprobs(target, prompt_ids: list[int], output_ids: list[int], temperature: float) -> torch.Tensor:
    """log p(output token | everything before it) under the target at `temperature`, one per output token."""
    ids = torch.tensor([prompt_ids + output_ids], device=next(target.parameters()).device)
    logits = target(ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt_ids):, None]).squeeze(1)
