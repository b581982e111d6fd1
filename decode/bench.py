"""`make eval-speedup`: measure acceptance and wall-clock speedup of speculative decoding; write a report.

    python -m decode.bench --config configs/smollm2.yaml [key.sub=value ...]

The stage itself is decode/eval_speedup.py.
"""

from __future__ import annotations

from common.cli import cli_config, run_cli


def main(argv: list[str] | None = None) -> dict:
    cfg = cli_config(argv, "Measure speculative-decoding acceptance and wall-clock speedup; write a report.")
    # Imported once the config is read and checked: the stage brings in transformers (~6 s on 2 cores), and a
    # bad setting is reported without waiting for it.
    from decode.eval_speedup import run

    return run(cfg, argv)


if __name__ == "__main__":
    run_cli(main)
