"""Which recipe `make demo` trains on this machine, and why: the first recipe of configs/demo-recipes.yaml whose
fresh-clone run fitted the time budget on a machine of this class when it was timed; the fallback where none did.

    python -m common.demo_recipe [--recipe auto|feature|standalone] [--minutes M]

prints the make target to run on stdout and the reasons on stderr, so the Makefile runs
`target=$(python -m common.demo_recipe ...) && make $target`. A recipe never timed on this class is not chosen
by guess: the timings of 2-core machines differ by 2-3x between classes, and a guess near the budget would be
a coin toss.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from common.cli import run_cli
from common.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "configs" / "demo-recipes.yaml"


@dataclass(frozen=True)
class Recipe:
    name: str
    make_target: str
    config: str
    what: str
    minutes: dict[str, float]
    """Minutes of a fresh clone's run after setup, by CPU class (common.precision.isa_class) or GPU name."""
    fallback: bool = False


@dataclass(frozen=True)
class Choice:
    recipe: Recipe
    reasons: list[str]


def load_recipes(path: Path = RECIPES) -> tuple[dict[str, float], list[Recipe]]:
    """(budget minutes by dtype, recipes in order of preference) from the table; exactly one recipe is the
    fallback and every config it names exists."""
    table = yaml.safe_load(path.read_text())
    recipes = [Recipe(**{**entry, "minutes": entry.get("minutes") or {}}) for entry in table["recipes"]]
    fallbacks = [r.name for r in recipes if r.fallback]
    if len(fallbacks) != 1:
        raise UserError(f"{path}: exactly one recipe must be the fallback, not {fallbacks or 'none'}")
    missing = [r.config for r in recipes if not (ROOT / r.config).is_file()]
    if missing:
        raise UserError(f"{path}: no config {', '.join(missing)}")
    return table["budget_minutes"], recipes


def choose(recipes: list[Recipe], machine: str, budget: float, asked: str = "auto") -> Choice:
    """The recipe to train on a machine of class `machine` in `budget` minutes: `asked` by name, or (auto) the
    first that was timed within the budget on this class, else the fallback."""
    names = [r.name for r in recipes]
    if asked != "auto":
        if asked not in names:
            raise UserError(f"DEMO_RECIPE={asked}: not one of auto, {', '.join(names)}")
        recipe = recipes[names.index(asked)]
        return Choice(recipe, [f"{recipe.name} draft chosen by DEMO_RECIPE={asked}"])
    reasons = []
    for recipe in recipes:
        minutes = recipe.minutes.get(machine)
        if minutes is not None and minutes <= budget:
            return Choice(recipe, reasons + [f"the {recipe.name} draft: {_timed(minutes)}, within the budget"])
        timed = _timed(minutes) + ", over the budget" if minutes is not None else "never timed on this class"
        reasons.append(f"not the {recipe.name} draft: {timed} (make {recipe.make_target} runs it)")
    fallback = next(r for r in recipes if r.fallback)
    return Choice(fallback, reasons + [f"the {fallback.name} draft, the fallback: no recipe was timed within the "
                                       f"budget on this class"])


def _timed(minutes: float) -> str:
    return f"{minutes:g} minutes from a fresh clone on this class"


def this_machine(device: str = "auto") -> tuple[str, str, str]:
    """(the class the table is keyed by: the CPU's widest extensions, or the GPU's name; the dtype
    generate.dtype=auto picks there; the machine in words) for the demo's device."""
    from common.models import resolve_device
    from common.precision import isa_class, machine_class, resolve_dtype
    resolved = resolve_device(device)
    described = machine_class(resolved)
    machine = isa_class() if resolved.type == "cpu" else described
    return machine, resolve_dtype("auto", resolved, "generate.dtype").name, described


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="auto", help="auto (the table's choice) or a recipe's name")
    parser.add_argument("--minutes", type=float, default=None,
                        help="the time budget (default: the table's for the dtype this machine computes in)")
    args = parser.parse_args(argv)
    if args.minutes is not None and args.minutes <= 0:
        raise UserError(f"DEMO_MINUTES={args.minutes:g}: a budget must be above 0 minutes")
    budgets, recipes = load_recipes()
    machine, dtype, described = this_machine()
    budget = args.minutes if args.minutes is not None else budgets[dtype]
    source = "DEMO_MINUTES" if args.minutes is not None else f"{dtype} here"
    choice = choose(recipes, machine, budget, args.recipe)
    print(f"make demo: {described}; budget {budget:g} minutes ({source})", file=sys.stderr)
    for reason in choice.reasons:
        print(f"make demo: {reason}", file=sys.stderr)
    print(f"make demo: training {choice.recipe.what} with {choice.recipe.config} (make {choice.recipe.make_target})",
          file=sys.stderr)
    print(choice.recipe.make_target)
    return choice.recipe.make_target


if __name__ == "__main__":
    run_cli(main)
