"""Verification cost of the batched (ragged) runner on the embedded target, by matmul layout.

For each batch size b and block length L: the median wall time of one RaggedRunner forward of L tokens per
row after a cached prefix of --prefix tokens per row (the block is rolled back after each forward, so the
cache does not grow), and r(b, L) = that time ÷ the time of L = 1 at the same b: what verifying L - 1
drafted tokens per row costs in target steps at that batch size. Layouts (decode/runners/projection.py):
"linear" (F.linear for every row count), "packed" (oneDNN), "mm", and "tuned" (each row count's layout
timed fastest when the runner is built, what RaggedRunner uses). `--bf16` adds the target in bf16 ("bf16":
its one layout, every row getting the bits of a one-token batch-1 forward). Layouts and lengths are
interleaved within each repeat, so a drift in the machine's speed falls on all alike.

    python scripts/bench_ragged_verify.py --batches 1 4 16 --lengths 1 2 3 4 --repeats 7 [--bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.models import EMBEDDED, load_model
from decode.runners import projection
from decode.runners.ragged import RaggedRunner


VOCAB = 49152  # the embedded target's vocabulary


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--layouts", nargs="+", default=["linear", "packed", "mm", "tuned"],
                        choices=["linear", "packed", "mm", "tuned"])
    parser.add_argument("--bf16", action="store_true", help="also time the target in bf16")
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def build(model, layout: str) -> RaggedRunner:
    if layout == "tuned":
        return RaggedRunner(model, VOCAB)
    fixed = (layout,) * len(projection.TIMED_ROWS)
    original = projection.tune_layouts

    def fix(projections):
        for p in projections:
            p.set_layouts(fixed)

    projection.tune_layouts = fix
    try:
        import decode.runners.ragged as ragged

        ragged.tune_layouts = fix
        return RaggedRunner(model, VOCAB)
    finally:
        projection.tune_layouts = original
        ragged.tune_layouts = original


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(EMBEDDED)
    runners = {layout: build(model, layout) for layout in args.layouts}
    if args.bf16:
        runners["bf16"] = RaggedRunner(load_model(EMBEDDED).to(torch.bfloat16), VOCAB)
    gen = torch.Generator().manual_seed(0)
    for b in args.batches:
        prompts = torch.randint(0, VOCAB, (b, args.prefix), generator=gen).tolist()
        for runner in runners.values():
            runner.reset()
            runner.add(prompts)
        times: dict[tuple[str, int], list[float]] = {}
        for repeat in range(args.repeats + 1):
            for length in args.lengths:
                tokens = torch.randint(0, VOCAB, (b, length), generator=gen)
                counts = torch.full((b,), length)
                for layout, runner in runners.items():
                    start = time.perf_counter()
                    runner.forward(tokens, counts)
                    seconds = time.perf_counter() - start
                    runner.truncate(torch.full((b,), args.prefix))
                    if repeat:  # the first pass allocates
                        times.setdefault((layout, length), []).append(seconds)
        for layout in runners:
            base = statistics.median(times[(layout, args.lengths[0])])
            cells = []
            for length in args.lengths:
                ms = statistics.median(times[(layout, length)]) * 1e3
                cells.append(f"L={length} {ms:6.1f} ms (r {ms / 1e3 / base:.2f})")
            print(f"b={b:<3} {layout:<7} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
