"""Throughput of generate-data's sampler vs HF `model.generate`, on the same prompts and settings.

    .venv/bin/python scripts/bench_generate.py --num-prompts 64 --threads 1

Prints tokens/s of real completion tokens (up to and including EOS) for: HF generate at batch 32,
our sampler (fp32 and bf16 GEMMs, with and without the teacher top-k cache), and score mode
(teacher-forced top-k over the same prompt+completion). Also prints how far bf16 logprobs are from
fp32. Not a timed test: the machine is shared, so the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common.models import EMBEDDED, load_model, load_tokenizer
from common.prompts import build_prompt_set
from common.sampling import SamplingParams
from decode.runners import make_batched_runner
from distill.generation.plan import Row
from distill.generation.runner_engine import RunnerEngine


def real_tokens(row: list[int], eos: int) -> int:
    return row.index(eos) + 1 if eos in row else len(row)


def hf_generate(model, prompts, args, eos: int) -> int:
    """HF generate in batches of args.hf_batch (left padding); returns real completion tokens."""
    total = 0
    for start in range(0, len(prompts), args.hf_batch):
        batch = prompts[start:start + args.hf_batch]
        L = max(map(len, batch))
        ids = torch.tensor([[eos] * (L - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=args.temperature,
                             top_p=args.top_p, top_k=0, max_new_tokens=args.max_new_tokens, pad_token_id=eos)
        total += sum(real_tokens(row, eos) for row in out[:, L:].tolist())
    return total


def ours_generate(runner, rows: list[Row], args, eos: int, teacher_topk: int):
    """generate-data's engine and batching: <= batch rows, <= max_batch_tokens slots."""
    engine = RunnerEngine(runner, [eos], args.batch, args.max_batch_tokens)
    sampling = SamplingParams(args.temperature, 0, args.top_p)
    return list(engine.generate(rows, sampling, args.max_new_tokens, teacher_topk, seed=0))


def timed(label: str, fn, tokens_of=lambda r: r):
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    tokens = tokens_of(result)
    print(f"{label:<38} {tokens:>6} tokens {seconds:7.1f} s {tokens / seconds:7.1f} tok/s", flush=True)
    return result, tokens / seconds


def bf16_accuracy(fp32_runner, bf16_runner, prompts, completions) -> str:
    """Mean KL(fp32 || bf16) per token and top-1 agreement over teacher-forced completion positions."""
    sequences = [p + c for p, c in zip(prompts, completions)]
    L = max(map(len, sequences))
    kl, agree, n = 0.0, 0, 0
    for i, seq in enumerate(sequences[:16]):
        a = fp32_runner.logits(fp32_runner.prefill([seq], L, all_hidden=True)[0]).log_softmax(-1)
        b = bf16_runner.logits(bf16_runner.prefill([seq], L, all_hidden=True)[0]).log_softmax(-1)
        sl = slice(len(prompts[i]) - 1, len(seq) - 1)
        kl += (a[sl].exp() * (a[sl] - b[sl])).sum().item()
        agree += (a[sl].argmax(-1) == b[sl].argmax(-1)).sum().item()
        n += sl.stop - sl.start
    return f"bf16 vs fp32 over {n} tokens: mean KL {kl / n:.2e} nats, top-1 agreement {agree / n:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--batch", type=int, default=128, help="our batch size")
    parser.add_argument("--max-batch-tokens", type=int, default=32768)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--teacher-topk", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load average at start {os.getloadavg()}")

    tokenizer = load_tokenizer(EMBEDDED)
    eos = tokenizer.eos_token_id
    prompt_set = build_prompt_set(["embedded"], tokenizer, max_prompts=args.num_prompts,
                                  max_new_tokens=args.max_new_tokens)
    # The plan's order: by length, so batches hold similar lengths.
    rows = [Row(p, 0) for p in sorted(prompt_set.prompts, key=lambda p: len(p.token_ids))]
    prompts = [list(r.prompt.token_ids) for r in rows]
    print(f"{len(prompts)} embedded prompts, {sum(map(len, prompts))} prompt tokens, "
          f"{args.max_new_tokens} new tokens, T={args.temperature}, top-p={args.top_p}")
    model = load_model(EMBEDDED)
    fp32, bf16 = make_batched_runner(model, "lean"), make_batched_runner(model, "lean", torch.bfloat16)
    ours_generate(fp32, rows[:4], argparse.Namespace(**{**vars(args), "max_new_tokens": 4}), eos, 0)  # warm-up

    count = lambda results: sum(len(r.completion_ids) for r in results)  # noqa: E731
    figures = {}
    if not args.skip_hf:
        with torch.inference_mode():
            _, figures["hf"] = timed(f"HF generate, batch {args.hf_batch}, fp32",
                                     lambda: hf_generate(model, prompts, args, eos))
    results, figures["fp32"] = timed(f"ours, batch {args.batch}, fp32", lambda: ours_generate(
        fp32, rows, args, eos, 0), count)
    _, figures["fp32_topk"] = timed(f"ours, fp32 + teacher top-{args.teacher_topk}", lambda: ours_generate(
        fp32, rows, args, eos, args.teacher_topk), count)
    _, figures["bf16"] = timed(f"ours, batch {args.batch}, bf16 GEMMs", lambda: ours_generate(
        bf16, rows, args, eos, 0), count)
    _, figures["bf16_topk"] = timed(f"ours, bf16 + teacher top-{args.teacher_topk}", lambda: ours_generate(
        bf16, rows, args, eos, args.teacher_topk), count)
    completions = [list(r.completion_ids) for r in results]
    scored_rows = [Row(row.prompt, 0, tuple(c)) for row, c in zip(rows, completions)]
    for label, runner in (("fp32", fp32), ("bf16", bf16)):
        engine = RunnerEngine(runner, [eos], 32, args.max_batch_tokens)  # score mode in batches of 32 rows
        timed(f"score mode, {label}, top-{args.teacher_topk}", lambda: sum(
            len(s.completion_ids) for s in engine.score(scored_rows, args.teacher_topk)))
    print(bf16_accuracy(fp32, bf16, prompts, completions))
    if "hf" in figures:
        print(f"speed-up over HF batch {args.hf_batch}: fp32 {figures['fp32'] / figures['hf']:.2f}x, "
              f"bf16 {figures['bf16'] / figures['hf']:.2f}x")
    print(f"teacher top-k overhead: fp32 {figures['fp32'] / figures['fp32_topk'] - 1:+.1%}, "
          f"bf16 {figures['bf16'] / figures['bf16_topk'] - 1:+.1%}")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
