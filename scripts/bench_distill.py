"""Training throughput: cached teacher (top-K logprobs from disk) vs online teacher (the frozen
target runs on every batch). Prints figures; not a test.

  .venv/bin/python -m scripts.bench_distill [--steps 8] [--rows 48] [--target embedded:smollm2-135m-instruct]

(run as a module from the repository root: the rows are written by the tests' shard fixture,
tests/synthetic_shards.py).

Both runs train the same draft (2% of the target, 8192-token subset) on the same rows, scored
once by the target up front (the cached run's data). tokens/s counts completion tokens per
second of optimizer steps, median over steps after the first (warm-up). Goal: cached >= 5x online.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common.config import load_config
from common.models import load_model
from distill.train import train
from tests.synthetic_shards import write_scored_shards


def tokens_per_s(out_dir: Path) -> list[float]:
    lines = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [l["train/tokens_per_s"] for l in lines if "train/tokens_per_s" in l]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()} (the machine may be shared: figures are noisy)")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        # Prompts 24-48 tokens, completions 48-96 tokens: about the shape of generate-data's output.
        write_scored_shards(tmp / "data", load_model(args.target), n_train=args.rows, n_eval=4,
                            prompt_len=(24, 48), completion_len=(48, 96), topk=32, pool=(300, 12000),
                            rows_per_shard=64)
        print(f"scored {args.rows + 4} rows with the target in {time.perf_counter() - t0:.1f}s")
        results = {}
        for teacher in ("cached", "online"):
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(True)
            out = tmp / teacher
            config = load_config(None, [
                f"target={args.target}", "device=cpu", f"distill.data_dirs=[{tmp / 'data'}]", f"distill.out_dir={out}",
                f"distill.teacher={teacher}", "distill.vocab_subset=8192", "distill.param_ratio=0.02",
                f"distill.micro_batch_size={args.micro_batch}", f"distill.max_steps={args.steps}",
                "distill.eval_every=0", "distill.save_every=0", "wandb.mode=disabled"])
            train(config)
            speeds = tokens_per_s(out)[1:]  # the first step warms up allocators and kernels
            results[teacher] = statistics.median(speeds)
            print(f"{teacher:>6} teacher: {results[teacher]:8.0f} completion tokens/s "
                  f"(median of {len(speeds)} steps, range {min(speeds):.0f}-{max(speeds):.0f})")
        print(f"cached / online = {results['cached'] / results['online']:.1f}x (goal >= 5x)")


if __name__ == "__main__":
    main()
