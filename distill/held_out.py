"""Exact held-out acceptance of drafts, side by side in one process, against the target itself.

    python -m distill.held_out --config configs/smollm2.yaml --drafts runs/a/final runs/b/final
    python -m distill.held_out --config configs/smollm2.yaml --drafts runs/smollm2/final runs/smollm2-feature/final

What it measures and how: distill/held_out_acceptance.py.
"""

from __future__ import annotations

import argparse

from common.cli import run_cli
from common.config import load_config


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML config: target, distill.data_dirs, eval_samples")
    parser.add_argument("--drafts", nargs="+", required=True,
                        help="draft folders (a run's final/ or best/), standalone or feature drafts")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    if any(T <= 0 for T in args.temperatures):
        parser.error("--temperatures must be > 0 (greedy acceptance is always reported)")
    # Imported once the arguments are read and checked: the measurement brings in transformers (~6 s on 2 cores).
    from distill.held_out_acceptance import compare

    return compare(config, args.drafts, args.temperatures, args.json)


if __name__ == "__main__":
    run_cli(main)
