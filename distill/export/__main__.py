"""python -m distill.export --run runs/x --out exports/x [--format hf|hf-full|gguf|target-gguf|eagle3|eagle3-gguf]
[--source final|best]"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.cli import run_cli
from distill.export.run import FORMATS, ExportOptions, export_run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a finished run's draft to a format another program loads.")
    parser.add_argument("--run", required=True, help="a `make distill` run folder (distill.out_dir)")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--format", default="hf", choices=sorted(FORMATS),
                        help="hf: the draft as trained; hf-full: a plain full-vocabulary HF model (HF "
                             "assistant_model, vLLM, SGLang); gguf: f16 and q8_0 GGUF files (llama.cpp -md); "
                             "target-gguf: the run's target as f16 and q8_0 GGUF files (llama.cpp -m); "
                             "eagle3: a feature draft as an EAGLE-3 head (vLLM and SGLang method eagle3); "
                             "eagle3-gguf: a feature draft as f16 and q8_0 GGUF files (llama.cpp "
                             "--spec-type draft-eagle3 -md)")
    parser.add_argument("--source", default="final", choices=["final", "best"],
                        help="final/ (the run's result) or best/ (best held-out α so far, also mid-run)")
    parser.add_argument("--target", help="the target model reference (default: the run's config.yaml `target`)")
    parser.add_argument("--target-gguf", type=Path,
                        help="gguf, target-gguf, eagle3-gguf: the target's GGUF file to copy tokenizer metadata from (default: the "
                             "embedded target's)")
    parser.add_argument("--lossy-acceptance", action="store_true",
                        help="hf-full/gguf: export a subset draft trained before the spread \"other\" row "
                             "although its full-vocabulary distribution differs from its own")
    args = parser.parse_args(argv)
    options = ExportOptions(lossy_acceptance=args.lossy_acceptance, target_gguf=args.target_gguf)
    print(export_run(args.run, args.out, args.format, args.source, options, args.target))


if __name__ == "__main__":
    run_cli(main)
