"""How often prompt lookup and the draft guess the target's next token, on the target's greedy outputs.

For each prompt the target decodes greedily; then at every output position this script asks
  * the draft (teacher-forced over the same text): is its argmax the target's token?
  * prompt lookup with n-grams of exactly n tokens (decode/lookup.py matches n..2): did the last n
    tokens occur earlier, and was the token after their latest occurrence the target's token?
It prints, per prompt set and n, how often a match exists, how often it is right, and how often it is
right where the draft is wrong: what lookup can add to a draft before any timing.

    python scripts/lookup_hit_rates.py --draft runs/smollm2-s3/final --data data/smollm2
"""

from __future__ import annotations

import argparse

import torch

from common.models import EMBEDDED, load_model, load_tokenizer
from common.prompts import load_prompt_set, read_split_prompts
from common.sampling import SamplingParams
from decode.api import build_runners
from decode.speculative import target_decode


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="draft model folder")
    p.add_argument("--data", default="data/smollm2", help="generate-data folder whose held-out split is used")
    p.add_argument("--in-domain", type=int, default=24, help="held-out in-domain prompts")
    p.add_argument("--humaneval", type=int, default=12, help="HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ngrams", type=int, nargs="+", default=[1, 2, 3])
    return p.parse_args(argv)


def exact_ngram_guess(context: list[int], n: int) -> int | None:
    """The token after the latest earlier occurrence of the last n tokens (no shorter fallback;
    n = 1 too, which the decoder's index does not match)."""
    tail = context[-n:]
    for start in range(len(context) - n - 1, -1, -1):
        if context[start:start + n] == tail:
            return context[start + n]
    return None


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(EMBEDDED)
    target, draft = load_model(EMBEDDED).eval(), load_model(args.draft).eval()
    target_runner, draft_runner = build_runners(target, draft)
    prompt_sets = {"in-domain": read_split_prompts(args.data, "eval")[: args.in_domain],
                   "humaneval": load_prompt_set("humaneval", tokenizer, limit=args.humaneval)}
    print(f"{'prompts':<10} {'n':>2} {'positions':>9} {'draft right':>11} {'match exists':>12} "
          f"{'match right':>11} {'match right where draft wrong':>29}")
    for name, prompts in prompt_sets.items():
        positions, draft_right = 0, 0
        exists = {n: 0 for n in args.ngrams}
        right = {n: 0 for n in args.ngrams}
        rescued = {n: 0 for n in args.ngrams}
        exists_draft_wrong = {n: 0 for n in args.ngrams}
        for prompt in prompts:
            ids = list(prompt.token_ids)
            out = target_decode(target_runner, torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                sampling=SamplingParams()).tolist()
            text = ids + out
            draft_runner.reset()
            draft_best = draft_runner.forward(torch.tensor(text[:-1]), len(out)).argmax(-1).tolist()
            for j, token in enumerate(out):
                context = text[: len(ids) + j]
                hit = draft_best[j] == token
                positions += 1
                draft_right += hit
                for n in args.ngrams:
                    guess = exact_ngram_guess(context, n)
                    if guess is not None:
                        exists[n] += 1
                        right[n] += guess == token
                        exists_draft_wrong[n] += not hit
                        rescued[n] += guess == token and not hit
        for n in args.ngrams:
            print(f"{name:<10} {n:>2} {positions:>9} {draft_right / positions:>11.1%} {exists[n] / positions:>12.1%} "
                  f"{right[n] / max(exists[n], 1):>11.1%} {rescued[n] / max(exists_draft_wrong[n], 1):>29.1%}")


if __name__ == "__main__":
    main()
