"""generate-data's two engines side by side: the same prompts and settings through the project
engine and through vLLM, each into a fresh folder, then their completion tok/s and the ratio.

    .venv/bin/python scripts/bench_generate_engines.py                   # the demo's prompts and settings
    .venv/bin/python scripts/bench_generate_engines.py --max-prompts 256 --order vllm,project

Each engine runs as `python -m distill.generate` in a process of its own, with configs/smollm2.yaml
unless --config says otherwise (T = 0.7, top-p 0.95, 96 new tokens, top-32 logprobs, bf16); extra
arguments are config overrides for both. The tok/s is each manifest's: completion tokens over
generation time, with model loading and vLLM's start-up outside it. Ends with the vLLM folder's
top-K against the project engine (distill/generation/equivalence.py). Run it on a quiet machine: the
load average is printed before and after each engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_engine(engine: str, args, overrides: list[str]) -> dict:
    out_dir = args.out / engine
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh folder: a resume would time only what was missing
    cmd = [sys.executable, "-m", "distill.generate", "--config", str(args.config), f"generate.engine={engine}",
           f"generate.out_dir={out_dir}", "wandb.mode=disabled", *overrides]
    if args.max_prompts:
        cmd.append(f"generate.max_prompts={args.max_prompts}")
    print(f"== {engine}: load average {os.getloadavg()[0]:.2f} before", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"== {engine}: load average {os.getloadavg()[0]:.2f} after", flush=True)
    return json.loads((out_dir / "manifest.json").read_text())["throughput_this_run"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "bench-engines")
    parser.add_argument("--max-prompts", type=int, default=0, help="0 = the config's")
    parser.add_argument("--order", default="project,vllm")
    parser.add_argument("--sample-rows", type=int, default=64, help="vLLM rows checked against the project engine")
    args, overrides = parser.parse_known_args()
    results = {engine: run_engine(engine, args, overrides) for engine in args.order.split(",")}
    print(f"{'engine':<8} {'tokens':>8} {'seconds':>8} {'tok/s':>8}")
    for engine, r in results.items():
        print(f"{engine:<8} {r['tokens']:>8} {r['seconds']:>8.1f} {r['tokens_per_s']:>8.1f}")
    if {"project", "vllm"} <= results.keys():
        ratio = results["vllm"]["tokens_per_s"] / results["project"]["tokens_per_s"]
        print(f"vllm / project: {ratio:.2f}x (issue 14's goal: >= 2x)")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "check_vllm_equivalence.py"), str(args.out / "vllm"),
                        "--rows", str(args.sample_rows)], cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
