"""`make distill`: train a small draft to imitate the target. The recipe reads top to bottom:
setup (data, draft, teacher, optimizer, resume) -> loop (train step, maybe evaluate, maybe save)
-> final export (distill/export/). A feature draft (distill.draft_kind=feature) trains under the same
loop with its own draft, teacher, loss, evaluation and export: distill/training/feature.py. The
standalone draft's recipe: distill/training/recipe.py.

  python -m distill.train --config configs/tiny.yaml distill.max_steps=20
  torchrun --standalone --nproc_per_node 2 -m distill.train --config ...           CPU: gloo, DDP
  ... distill.deepspeed_config=configs/deepspeed_zero2.json                         ZeRO-2/3
  accelerate launch --config_file configs/fsdp.yaml -m distill.train --config ...   GPUs: FSDP
"""

from __future__ import annotations

import signal

from common.cli import cli_config, run_cli


def recipe_class(config) -> type:
    """The recipe of the config's draft kind (imported here, after the config is read and checked: the recipes
    bring in transformers and accelerate, so a bad setting is reported in ~2.5 s instead of ~8 on 2 cores)."""
    from distill.training.feature import FeatureRecipe
    from distill.training.recipe import DistillRecipe

    return FeatureRecipe if config.distill.draft_kind == "feature" else DistillRecipe


def train(config) -> dict:
    recipe_kind = recipe_class(config)
    recipe = recipe_kind(config)
    if not recipe.setup():
        del recipe  # its models go before the fresh recipe builds its own
        recipe = recipe_kind(config)  # seeded again: the same initial draft as a run that never saved
        recipe.setup(resume=False)
    summary = recipe.train()
    if config.distill.export and recipe.is_main and summary["stopped"] != "interrupted":
        from distill.export.serving import export_for_serving  # the exporters load gguf and the target

        for line in export_for_serving(config):
            recipe.say(line)
    return summary


def main(argv: list[str] | None = None) -> dict:
    config = cli_config(argv, "Distil a draft model from the target (make distill).")
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return train(config)
    finally:  # in-process callers (tests) get their own SIGTERM handling back
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    run_cli(main)
