"""Per-step latency and verification cost r(k) of the runners on the embedded target.

Runners: hf, lean, and on CUDA graph (the lean forward replayed from CUDA graphs).

r(k) = time(one forward of k + 1 tokens) / time(one forward of 1 token), both after a cached
prefix of --prefix tokens: what verifying k drafted tokens costs in target steps. Also the
step latency of a small subset-vocabulary draft and c = draft step / target step.

Runners and lengths are interleaved within each repeat so machine noise hits all alike;
medians over repeats after --warmup discarded ones, with the 25-75% range. On a shared CPU
`--clock cpu` (this process's CPU time; meaningful with --threads 1) is far less noisy than wall.

    python scripts/bench_verify_cost.py --repeats 15
    python scripts/bench_verify_cost.py --repeats 15 --fixed-layouts   # + lean with the pre-2026-12-02 layout rule
    python scripts/bench_verify_cost.py --device cuda --dtype bf16
    python scripts/bench_verify_cost.py --runners lean --dtype fp32 bf16 --ks 1 4 8 16 32 64   # dtypes side by side

With several dtypes each runner is built once per dtype ("lean bf16"), all timed interleaved, and the
last column gives each forward in steps of the first dtype's runner ("÷ lean fp32"): what a
verification costs against the faster target-only loop.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.models import EMBEDDED, load_model
from decode.runners import projection
from decode.runners.graphs import GraphRunner
from decode.runners.hf import HFRunner
from decode.runners.lean import LeanRunner
from decode.timing import synchronize
from decode.vocab import VocabSubset


VOCAB = 49152  # the embedded target's vocabulary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=100, help="cached context before each timed forward")
    p.add_argument("--max-k", type=int, default=8, help="largest number of drafted tokens verified")
    p.add_argument("--ks", type=int, nargs="+", default=None,
                   help="drafted tokens (or tree nodes) to time instead of 1..--max-k")
    p.add_argument("--runners", nargs="+", choices=["hf", "lean"], default=["hf", "lean"])
    p.add_argument("--repeats", type=int, default=15, help="timed repeats (medians are over these)")
    p.add_argument("--warmup", type=int, default=3, help="untimed repeats first")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: perf_counter; cpu: process CPU time (use with --threads 1 on a busy machine)")
    p.add_argument("--draft-hidden", type=int, default=256)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-subset", type=int, default=8192, help="draft vocabulary subset size (+1 'other' row)")
    p.add_argument("--draft-steps", type=int, default=200, help="timed draft steps per runner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (adds the CUDA-graph runner)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], nargs="+", default=["fp32"])
    p.add_argument("--fixed-layouts", action="store_true",
                   help="also time 'lean-fixed': the lean runner with the layout rule used before layouts were "
                        "measured per machine (gemv for a small draft's layers, w @ x.T for 1-2 rows, packed for more)")
    return p.parse_args(argv)


def build_draft(hidden: int, layers: int, subset: int, seed: int) -> LlamaForCausalLM:
    """A random Llama draft over `subset` ids of the target's vocabulary (timing only)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=subset + 1, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=1, max_position_embeddings=8192, tie_word_embeddings=True)
    VocabSubset(sorted(torch.randperm(VOCAB)[:subset].tolist()), VOCAB).write_to(config)
    return LlamaForCausalLM(config).eval()


def make_runners(model: LlamaForCausalLM, names: list[str], fixed_layouts: bool = False) -> dict:
    kinds = {"hf": HFRunner, "lean": LeanRunner}
    runners = {name: kinds[name](model, VOCAB) for name in names}
    if fixed_layouts:
        runners["lean-fixed"] = fixed_rule_runner(model)
    if next(model.parameters()).device.type == "cuda":
        runners["graph"] = GraphRunner(LeanRunner(model, VOCAB))
    return runners


class FixedRuleProjection(projection.Projection):
    """The one layout rule measured on an AMD EPYC (Zen 4) and used before layouts were timed per
    machine: gemv for a small draft's layers (< 256 inputs and < 4096 outputs), w @ x.T for 1-2 rows,
    oneDNN packed weights for more (CPU fp32 only)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(w, bias, layouts=("packed",) * len(projection.TIMED_ROWS))
        self.few_rows = "linear" if w.shape[1] < 256 and w.shape[0] < 4096 else "mm"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.few_rows if x.shape[0] <= 2 else "packed", x)


def fixed_rule_runner(model: LlamaForCausalLM) -> LeanRunner:
    """The lean runner with FixedRuleProjection (for comparison with the measured layouts)."""
    if next(model.parameters()).device.type != "cpu" or next(model.parameters()).dtype != torch.float32:
        raise SystemExit("error: --fixed-layouts compares CPU fp32 layouts; use --device cpu --dtype fp32")
    with mock.patch("decode.runners.lean.Projection", FixedRuleProjection):
        return LeanRunner(model, VOCAB)


def time_forwards(runners: dict, prefix: torch.Tensor, lengths: list[int], repeats: int, warmup: int,
                  clock) -> dict:
    """{(runner name, n): [seconds]} for forward(n tokens, n logits) after the cached prefix
    (the device synchronised before reading the clock)."""
    for runner in runners.values():
        runner.reset()
        runner.forward(prefix, 1)
    times = {(name, n): [] for name in runners for n in lengths}
    gen = torch.Generator().manual_seed(1)
    for rep in range(warmup + repeats):
        for n in lengths:
            ids = torch.randint(0, VOCAB, (n,), generator=gen)
            for name, runner in runners.items():
                synchronize(runner.device)
                start = clock()
                runner.forward(ids, n)
                synchronize(runner.device)
                elapsed = clock() - start
                runner.rollback(prefix.shape[0])
                if rep >= warmup:
                    times[(name, n)].append(elapsed)
    return times


def summary(xs: list[float]) -> tuple[float, float, float]:
    """(median, 25th, 75th percentile) in ms."""
    q = statistics.quantiles(xs, n=4)
    return statistics.median(xs) * 1e3, q[0] * 1e3, q[2] * 1e3


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"torch threads: {torch.get_num_threads()}, clock: {args.clock}, prefix: {args.prefix}, "
          f"repeats: {args.repeats} (+{args.warmup} warm-up)")

    device = torch.device(args.device)
    dtypes = {name: {"fp32": torch.float32, "bf16": torch.bfloat16}[name] for name in args.dtype}
    named = (lambda name, dtype: name) if len(dtypes) == 1 else (lambda name, dtype: f"{name} {dtype}")
    runners = {}
    for dtype_name, dtype in dtypes.items():
        target = load_model(EMBEDDED, device, dtype)
        for name, runner in make_runners(target, args.runners, args.fixed_layouts).items():
            runners[named(name, dtype_name)] = runner
    prefix = torch.randint(0, VOCAB, (args.prefix,), generator=torch.Generator().manual_seed(args.seed))
    lengths = sorted({1} | {k + 1 for k in args.ks}) if args.ks else list(range(1, args.max_k + 2))
    times = time_forwards(runners, prefix, lengths, args.repeats, args.warmup, clock)

    step = {name: summary(times[(name, 1)])[0] for name in runners}
    for name in runners:
        med, lo, hi = summary(times[(name, 1)])
        print(f"target step ({name}): {med:.2f} ms (25-75%: {lo:.2f}-{hi:.2f})")
    base = next(iter(runners))
    across = f"÷ {base}" if len(dtypes) > 1 else None
    print("\n k " + "".join(f"{name + ' ms':>14}" for name in runners)
          + "".join(f"{'r_' + name:>12}" for name in runners) + (f"{across:>14}" * (len(runners) - 1) if across else "")
          + "   (ms: forward of k + 1 tokens)")
    for n in lengths:
        ms = {name: summary(times[(name, n)])[0] for name in runners}
        print(f"{n - 1:>2} " + "".join(f"{ms[name]:>14.2f}" for name in runners)
              + "".join(f"{ms[name] / step[name]:>12.2f}" for name in runners)
              + ("".join(f"{ms[name] / step[base]:>14.2f}" for name in list(runners)[1:]) if across else ""))

    draft_runners = {}
    for dtype_name, dtype in dtypes.items():
        draft = build_draft(args.draft_hidden, args.draft_layers, args.draft_subset, args.seed).to(device, dtype)
        for name, runner in make_runners(draft, args.runners, args.fixed_layouts).items():
            draft_runners[named(name, dtype_name)] = runner
    params = sum(p.numel() for p in draft.parameters())
    draft_times = time_forwards(draft_runners, prefix, [1], args.draft_steps, 20, clock)
    print(f"\ndraft: hidden {args.draft_hidden}, {args.draft_layers} layers, {args.draft_subset}+1 vocab, "
          f"{params / 1e6:.2f}M params")
    for name in draft_runners:
        med, lo, hi = summary(draft_times[(name, 1)])
        print(f"draft step ({name}): {med:.3f} ms (25-75%: {lo:.3f}-{hi:.3f}), "
              f"c = draft step / target step ({name}) = {med / step[name]:.3f}")

if __name__ == "__main__":
    main()
