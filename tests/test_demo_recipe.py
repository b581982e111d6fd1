"""`make demo` trains the recipe of configs/demo-recipes.yaml timed within this machine's budget, and says why."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common import demo_recipe
from common.demo_recipe import Recipe, choose, load_recipes
from common.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def recipe(name, minutes, fallback=False):
    return Recipe(name, f"demo-{name}", "configs/tiny.yaml", f"a {name} draft", minutes, fallback)


FEATURE = recipe("feature", {"AVX2": 47.7})
STANDALONE = recipe("standalone", {"AVX2": 39.1, "AVX-512 BF16 + AMX": 18.4}, fallback=True)


def test_the_first_recipe_timed_within_the_budget_is_chosen():
    assert choose([FEATURE, STANDALONE], "AVX2", 50).recipe is FEATURE
    chosen = choose([FEATURE, STANDALONE], "AVX2", 45)
    assert chosen.recipe is STANDALONE
    assert "not the feature draft: 47.7 minutes" in chosen.reasons[0] and "over the budget" in chosen.reasons[0]
    assert "39.1 minutes" in chosen.reasons[-1]


def test_a_recipe_never_timed_on_this_class_is_not_guessed():
    chosen = choose([FEATURE, STANDALONE], "AVX-512 BF16 + AMX", 25)
    assert chosen.recipe is STANDALONE
    assert "feature draft: never timed on this class" in chosen.reasons[0]


def test_the_fallback_where_nothing_was_timed_within_the_budget():
    for machine, budget in (("Arm BF16", 25), ("AVX2", 30)):
        chosen = choose([FEATURE, STANDALONE], machine, budget)
        assert chosen.recipe is STANDALONE
        assert "the fallback" in chosen.reasons[-1]


def test_a_recipe_asked_by_name_runs_whatever_its_time():
    assert choose([FEATURE, STANDALONE], "AVX2", 1, asked="feature").recipe is FEATURE
    with pytest.raises(UserError, match="DEMO_RECIPE=tree: not one of auto, feature, standalone"):
        choose([FEATURE, STANDALONE], "AVX2", 45, asked="tree")


def test_the_shipped_table_names_real_configs_and_make_targets():
    budgets, recipes = load_recipes()
    assert set(budgets) == {"bf16", "fp32"}
    makefile = (ROOT / "Makefile").read_text()
    for entry in recipes:
        assert f"\n{entry.make_target}: setup" in makefile
        assert all(minutes > 0 for minutes in entry.minutes.values())


@pytest.mark.parametrize("change, message", [
    (lambda table: table["recipes"][0].update(fallback=True), "exactly one recipe must be the fallback"),
    (lambda table: table["recipes"][0].update(config="configs/none.yaml"), "no config configs/none.yaml"),
])
def test_a_broken_table_is_refused(tmp_path, change, message):
    table = yaml.safe_load(demo_recipe.RECIPES.read_text())
    change(table)
    path = tmp_path / "recipes.yaml"
    path.write_text(yaml.safe_dump(table))
    with pytest.raises(UserError, match=message):
        load_recipes(path)


def test_main_prints_the_make_target_alone_on_stdout_and_the_reasons_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(demo_recipe, "this_machine", lambda: ("AVX2", "fp32", "a 2-core AVX2 CPU"))
    demo_recipe.main([])
    out, err = capsys.readouterr()
    assert out == "demo-standalone\n"
    assert "budget 45 minutes (fp32 here)" in err and "make demo-standalone" in err
    demo_recipe.main(["--minutes", "60"])
    assert capsys.readouterr().out == "demo-feature\n"


def test_make_demo_runs_the_chosen_recipes_stages():
    # make -n still runs the line that calls $(MAKE): the choice is made, the sub-make's stages only printed.
    venv = Path(sys.prefix)
    for asked, config in (("feature", "configs/smollm2-feature.yaml"), ("standalone", "configs/smollm2.yaml")):
        result = subprocess.run(["make", "-n", "-o", f"{venv}/.installed", f"VENV={venv}", f"DEMO_RECIPE={asked}",
                                 "demo"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        stages = [line.split(" -m ")[1].split()[:3] for line in result.stdout.splitlines() if " -m " in line]
        modules = [stage[0] for stage in stages if stage[0] != "common.demo_recipe"]
        assert modules[0] == "distill.generate" and modules[-1] == "decode.bench"
        assert {stage[2] for stage in stages if stage[0] != "common.demo_recipe"} == {config}
        assert f"chosen by DEMO_RECIPE={asked}" in result.stderr
