"""Time one draw from a distribution: torch.multinomial vs the project's sampler (common/sampling.py).

Per vocabulary size (a subset draft's 8,192 rows, SmolLM2's 49,152 tokens), the median over
--repeats draws from one T = 0.7 softmax, both methods interleaved in one process.

    python scripts/bench_sampler.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.sampling import sample


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 49152])
    p.add_argument("--repeats", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    methods = {"torch.multinomial": lambda p: torch.multinomial(p[None], 1, generator=generator),
               "common.sampling.sample": lambda p: sample(p, generator)}
    for vocab in args.vocab:
        probs = (torch.randn(vocab, generator=generator) * 3 / 0.7).softmax(-1)
        times = {name: [] for name in methods}
        for i in range(args.repeats + 20):  # the first 20 rounds warm up
            for name, draw in methods.items():
                start = time.perf_counter()
                draw(probs)
                if i >= 20:
                    times[name].append(time.perf_counter() - start)
        line = ", ".join(f"{name} {1e3 * statistics.median(t):.3f} ms" for name, t in times.items())
        print(f"vocabulary {vocab}: {line}")


if __name__ == "__main__":
    main()
