"""`make features`: the target's hidden states of the layers a feature draft reads, computed once for
every row of the training data, so that `distill.teacher=stored` trains without running the target.

    python -m distill.features --config configs/smollm2-feature.yaml [key.sub=value ...]

The files, their checks and the target pass that writes them: distill/feature_store.py.
"""

from __future__ import annotations

from common.cli import cli_config, run_cli


# What the demo's features take on disk (--help); distill/feature_store.py says how it is counted.
DEMO_SIZE = "~1.5 GB for the demo's data (~2.5k rows x ~170 tokens x 3 layers x 576 x 2 bytes)"


def main(argv: list[str] | None = None) -> dict:
    config = cli_config(argv, "Store the target's hidden states of the layers a feature draft reads for every "
                              "row of distill.data_dirs (make features), so distill.teacher=stored trains "
                              f"without running the target. Size: tokens x layers x width x 2 bytes, {DEMO_SIZE}. "
                              "Per forward: at most generate.batch_size rows and distill.feature_batch_tokens positions.")
    # Imported once the config is read and checked: the stage brings in transformers (~6 s on 2 cores), and a
    # bad setting is reported without waiting for it.
    from distill.feature_store import store

    summary = store(config)
    print(f"features: {summary['written']} shard(s) written, {summary['skipped']} already complete; layers "
          f"{summary['layers']}; {summary['bytes'] / 1e9:.2f} GB in {', '.join(summary['folders'])}")
    return summary


if __name__ == "__main__":
    run_cli(main)
