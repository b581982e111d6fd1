"""eval-speedup with a feature draft (decode/bench.py): its rows next to the standalone draft's on the same
prompts, alone, and the bad inputs refused before any model loads or any timing starts."""

import json

import pytest
import torch

from common.config import ConfigError, load_config
from common.models import TokenizerMismatch, load_model, load_tokenizer
from decode.bench import main
from decode.drafts.feature.model import FeatureDraftMismatch
from decode.eval_speedup import setup, warm_prompt_shapes
from decode.runners import make_runner
from decode.runners.lean import LeanRunner
from decode.stats import predicted_speedup
from decode.timing import verify_cost
from tests.conftest import random_feature_draft


TINY = "configs/tiny.yaml"
# Every 96th id of the embedded tokenizer's 49,152 (the tiny target's vocabulary): a 512-row head.
HEAD_IDS = list(range(0, 49152, 96))


@pytest.fixture(scope="module")
def feature_folder(tmp_path_factory):
    """A random feature draft for tiny:target (2 layers, width 64), saved as FeatureDraft.save leaves it."""
    folder = tmp_path_factory.mktemp("feature") / "final"
    random_feature_draft(load_model("tiny:target"), HEAD_IDS, init_std=0.05).save(folder)
    return folder


def eval_speedup(out_dir, *overrides) -> dict:
    main(["--config", TINY, "eval.prompts=[gsm8k]", "eval.ks=[2]", "eval.hf_baselines=false", "eval.warmup=0",
          "eval.r_max_k=2", "eval.max_new_tokens=8", f"eval.out_dir={out_dir}", "wandb.mode=disabled", *overrides])
    return json.loads((out_dir / "report.json").read_text())


def test_both_draft_kinds_side_by_side(tmp_path, feature_folder, one_thread):
    report = eval_speedup(tmp_path, "draft=tiny:draft", f"eval.feature_draft={feature_folder}", "eval.lookup_ngram=3")
    rows = {(r["proposer"], r["temperature"]): r for r in report["results"]}
    assert set(rows) == {(p, t) for p in ("draft", "draft+lookup", "feature", "feature+lookup") for t in (0.0, 0.7)}
    assert all(r["greedy_identical"] for r in report["results"] if r["temperature"] == 0)
    for proposer in ("feature", "feature+lookup"):
        row = rows[(proposer, 0.0)]
        assert row["predicted_speedup"] > 0 and row["draft_steps_per_forward"] <= 2
    assert report["feature_draft"]["params"] == sum(p.numel() for p in random_feature_draft(
        load_model("tiny:target"), HEAD_IDS).parameters())
    assert report["feature_draft"]["vocab_subset"] == 512 and report["feature_draft"]["target_layers"] == [0, 1]
    feature_cost = report["feature_cost_model"]
    assert feature_cost["start"]["c"] > 0 and set(map(int, feature_cost["start"]["r"])) == {1, 2}
    assert report["cost_model"] != feature_cost["start"]  # the standalone draft's, on the plain runner
    markdown = (tmp_path / "report.md").read_text()
    assert f"feature draft `{feature_folder}`" in markdown and "reads layers [0, 1]" in markdown
    assert "Feature draft (`feature` rows)" in markdown
    samples = {json.loads(line)["method"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()}
    assert {"speculative k=2 feature", "speculative k=2 feature + lookup", "speculative k=2 + lookup"} <= samples


@pytest.mark.filterwarnings("ignore:eval.dtype=bf16 on a device without native bf16")
def test_both_drafts_decode_in_fp32_beside_a_bf16_target_on_a_cpu(tmp_path, feature_folder, one_thread):
    report = eval_speedup(tmp_path, "draft=tiny:draft", f"eval.feature_draft={feature_folder}", "eval.dtype=bf16",
                          "device=cpu", "eval.trees=['2x1']", "eval.temperatures=[0.0]")
    assert report["dtype"]["dtype"] == "bf16"
    assert report["draft"]["dtype"] == report["feature_draft"]["dtype"] == "fp32"
    assert {(r["proposer"], r["tree"]) for r in report["results"]} == {
        (p, t) for p in ("draft", "feature") for t in (None, "2x1")}
    assert all(r["greedy_identical"] for r in report["results"])


def test_each_prompt_is_prefilled_on_every_runner_before_its_timed_runs(feature_folder, one_thread):
    s = setup(load_config(TINY, ["draft=tiny:draft", f"eval.feature_draft={feature_folder}", "eval.prompts=[gsm8k]"]))
    prompt = torch.tensor([next(iter(s.prompt_sets.values()))[0].token_ids])
    fed: dict[str, list[int]] = {"target": [], "draft": [], "feature": []}
    for name, runner in (("target", s.target_runner), ("draft", s.draft_runner), ("feature", s.feature_runner)):
        forward = runner.forward
        runner.forward = lambda ids, *a, _f=forward, _rows=fed[name], **k: _rows.append(len(ids)) or _f(ids, *a, **k)
    warm_prompt_shapes(s, prompt)
    assert all(prompt.shape[1] - 1 in rows for rows in fed.values()), fed


def test_a_feature_draft_alone(tmp_path, feature_folder, one_thread):
    report = eval_speedup(tmp_path, f"draft={feature_folder}", "eval.temperatures=[0.0]")
    assert {r["proposer"] for r in report["results"]} == {"feature"}
    assert report["draft"] is None and report["feature_draft"]["ref"] == str(feature_folder)
    assert report["cost_model"] == report["feature_cost_model"]["start"]
    assert all(r["greedy_identical"] for r in report["results"])


@pytest.mark.parametrize("drafts, kinds", [(("draft=tiny:draft", "eval.feature_draft={}"), ("draft", "feature")),
                                           (("draft={}",), ("feature",))])
def test_serving_table_with_the_feature_draft(tmp_path, feature_folder, one_thread, drafts, kinds):
    report = eval_speedup(tmp_path, *(d.format(feature_folder) for d in drafts), "eval.temperatures=[0.0]",
                          "eval.serving_batches=[2]", "eval.serving_requests=4")
    rows = {r["method"]: r for r in report["serving"]["rows"]}
    assert set(rows) == {"target-only"} | {m for kind in kinds for m in (kind, f"{kind} auto")}
    assert all(r["greedy_identical"] and r["requests"] == 4 and r["tokens"] > 0 for r in rows.values())
    assert rows["feature"]["k"] == 2 and 1.0 <= rows["feature"]["tau"] <= 3.0


def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("decode.eval_speedup.load_model", refuse)


def test_missing_or_doubled_feature_drafts_are_refused_before_any_model_loads(tmp_path, feature_folder, monkeypatch):
    no_model_loads(monkeypatch)
    with pytest.raises(ConfigError, match=r"eval.feature_draft: feature draft folder .*nowhere.* does not exist"):
        eval_speedup(tmp_path, "draft=tiny:draft", f"eval.feature_draft={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match="is a feature draft already"):
        eval_speedup(tmp_path, f"draft={feature_folder}", f"eval.feature_draft={feature_folder}")


def test_a_feature_draft_for_another_target_is_refused_before_timing(tmp_path, monkeypatch):
    """tiny:draft is 32 wide and 1 layer deep; the check runs before any runner is built."""
    folder = tmp_path / "other"
    random_feature_draft(load_model("tiny:draft"), HEAD_IDS, target_layers=(0,)).save(folder)
    monkeypatch.setattr("decode.eval_speedup.make_runner", lambda *a, **k: pytest.fail("a runner was built"))
    with pytest.raises(FeatureDraftMismatch, match="hidden size 32 vs the target's 64; trained on a 1-layer target"):
        eval_speedup(tmp_path, f"draft={folder}")


def test_a_feature_draft_saved_with_another_tokenizer_is_refused(tmp_path, monkeypatch):
    """Training saves the target's tokenizer next to the draft; a different one is refused before timing."""
    folder = tmp_path / "draft"
    random_feature_draft(load_model("tiny:target"), HEAD_IDS).save(folder)
    tokenizer = load_tokenizer("tiny:target")
    tokenizer.add_tokens(["<not-in-the-target>"])
    tokenizer.save_pretrained(folder)
    monkeypatch.setattr("decode.eval_speedup.make_runner", lambda *a, **k: pytest.fail("a runner was built"))
    with pytest.raises(TokenizerMismatch, match="tokenizers differ"):
        eval_speedup(tmp_path, "draft=tiny:draft", f"eval.feature_draft={folder}")


def test_the_feature_runner_keeps_the_layers_the_draft_reads(feature_folder):
    """What bench verifies with: the lean runner, keeping the draft's layers (the plain runner keeps none)."""
    from decode.api import build_feature_runner
    from decode.drafts.feature.model import FeatureDraft

    target = load_model("tiny:target")
    runner = build_feature_runner(target, FeatureDraft.load(feature_folder))
    assert isinstance(runner, LeanRunner) and runner.hidden_layers == (0, 1)
    runner.forward(torch.tensor([1, 2, 3]), 1)
    assert runner.hidden_states.shape == (3, 2, 64)
    assert make_runner(target, 49152).hidden_layers == ()


def test_trees_of_both_draft_kinds_beside_their_chains(tmp_path, feature_folder, one_thread):
    trees = ["2x1", "dynamic:depth=3,branch=2,nodes=auto"]
    report = eval_speedup(tmp_path, "draft=tiny:draft", f"eval.feature_draft={feature_folder}",
                          f"eval.trees=[{trees[0]}, '{trees[1]}']")
    rows = {(r["proposer"], r["tree"], r["temperature"]): r for r in report["results"]}
    assert set(rows) == {(p, tree, t) for p in ("draft", "feature") for tree in (None, *trees) for t in (0.0, 0.7)}
    assert all(r["greedy_identical"] for r in report["results"] if r["temperature"] == 0)
    for (proposer, tree, _), row in rows.items():
        assert row["k"] == (2 if tree in (None, "2x1") else 3)
        assert 1 <= row["tau"] <= row["k"] + 1 and row["predicted_speedup"] > 0
        if tree == "2x1":  # 2 children at depth 1, one each below: 4 nodes (fewer near the end)
            assert 1 < row["verified_per_forward"] <= 4
        if tree and tree.startswith("dynamic"):  # the budget the cost model chose: 1..14 nodes (none in a last block)
            assert 0 < row["verified_per_forward"] <= 14
    for cost in (report["cost_model"], report["feature_cost_model"]["start"]):
        assert set(map(int, cost["r"])) == {1, 2, 12, 14}  # chains' k, then node counts up to the largest tree's
        assert set(map(int, cost["r_tree"])) == {1, 2, 12, 14} and all(v > 0 for v in cost["r_tree"].values())
    for row in report["results"]:  # a tree row is priced by a tree's forward, a chain's by a chain's
        cost = report["cost_model"] if row["proposer"] == "draft" else report["feature_cost_model"]["start"]
        r_block = (verify_cost(cost["r_tree"], max(row["verified_per_forward"], 1.0)) if row["tree"] else
                   verify_cost(cost["r"], row["k"]))
        expected = predicted_speedup(row["tau"], row["draft_steps_per_forward"], cost["c"], r_block)
        assert row["predicted_speedup"] == pytest.approx(expected)
    markdown = (tmp_path / "report.md").read_text()
    assert "| r_tree(n) |" in markdown
    assert "| draft | 3 | dynamic:depth=3,branch=2,nodes=auto |" in markdown
    assert (tmp_path / "chains_vs_trees.png").stat().st_size > 0


def test_a_bad_tree_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("decode.eval_speedup.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="eval.trees: tree '3x0': every depth needs at least one child"):
        eval_speedup(tmp_path, "draft=tiny:draft", "eval.trees=[3x0]")
    with pytest.raises(ConfigError, match="node budget of 0"):
        eval_speedup(tmp_path, "draft=tiny:draft", "eval.trees=['dynamic:depth=2,branch=2,nodes=0']")
