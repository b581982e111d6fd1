"""python -m distill.export --run runs/x --out exports/x [--format hf] [--source final|best]"""

from __future__ import annotations

import argparse

from decode.cli import run_cli
from distill.export.run import FORMATS, export_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a finished run's draft to a format another program loads.")
    parser.add_argument("--run", required=True, help="a `make distill` run folder (distill.out_dir)")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--format", default="hf", choices=sorted(FORMATS))
    parser.add_argument("--source", default="final", choices=["final", "best"],
                        help="final/ (the run's result) or best/ (best held-out α so far, also mid-run)")
    args = parser.parse_args(argv)
    print(export_run(args.run, args.out, args.format, args.source))


if __name__ == "__main__":
    run_cli(main)
