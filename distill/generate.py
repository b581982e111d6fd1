"""`make generate-data`: sample target completions (or score text) into Parquet shards + manifest.

    python -m distill.generate --config configs/tiny.yaml generate.out_dir=data/x
    torchrun --standalone --nproc_per_node 2 -m distill.generate --config configs/smollm2.yaml

The stage itself is distill/generation/run.py; its pieces live in distill/generation/.
"""

from __future__ import annotations

from common.cli import cli_config, run_cli


def main(argv: list[str] | None = None) -> None:
    config = cli_config(argv, "Sample target completions (or score text) into Parquet shards + manifest.json.")
    # Imported once the config is read and checked: the stage brings in transformers (~6 s on 2 cores), and a
    # bad setting is reported without waiting for it.
    from distill.generation.run import run

    run(config)


if __name__ == "__main__":
    run_cli(main)
