"""On-policy rounds (distill/onpolicy.py) on tiny models: the draft's rollouts, scored by the target, join the
mixture and training continues from that draft; reruns skip what is finished; bad input stops first."""

import json
import subprocess
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from common.models import model_hash
from distill import onpolicy
from distill.generation.run import run as generate
from distill.onpolicy import mixture_weights, run_onpolicy
from distill.train import train


ROOT = Path(__file__).resolve().parents[1]
SMALL = ["generate.max_prompts=24", "generate.shard_size=8", "generate.max_new_tokens=8", "generate.batch_size=8",
         "generate.eval_fraction=0.25", "distill.max_steps=3", "distill.eval_every=3", "distill.save_every=3",
         "distill.export=false", "onpolicy.steps=2", "onpolicy.max_prompts=16", "wandb.mode=disabled"]


def config_for(tmp_path, *overrides):
    return load_config(ROOT / "configs/tiny.yaml", [f"generate.out_dir={tmp_path}/data",
                                                    f"distill.data_dirs=[{tmp_path}/data]",
                                                    f"distill.out_dir={tmp_path}/run", *SMALL, *overrides])


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """The tiny config's data and a 3-step draft: what `make onpolicy` starts from."""
    from accelerate.state import AcceleratorState

    tmp_path = tmp_path_factory.mktemp("distilled")
    generate(config_for(tmp_path))
    AcceleratorState._reset_state(True)
    train(config_for(tmp_path))
    return tmp_path


def test_a_round_trains_the_draft_on_its_own_rollouts_scored_by_the_target(distilled, tmp_path, monkeypatch):
    out = tmp_path / "onpolicy"
    (record,) = run_onpolicy(config_for(distilled, f"onpolicy.out_dir={out}"))
    draft = str(distilled / "run" / "final")
    assert record["draft"] == draft and record["draft_hash"] == model_hash(draft) and record["draft_step"] == 3
    plan = json.loads((out / "round-1" / "rollouts" / "plan.json").read_text())
    assert plan["rollout_draft_hash"] == model_hash(draft) and plan["temperature"] == 0.7 and plan["seed"] == 1
    trained = load_config(out / "round-1" / "train.yaml")
    assert trained.distill.init == draft and trained.distill.data_weights == [0.5, 0.5]
    assert trained.distill.data_dirs == [str(distilled / "data"), str(out / "round-1" / "rollouts")]
    assert (out / "round-1" / "run" / "final" / "model.safetensors").is_file() and 0 < record["alpha"] <= 1
    assert record["rollout_tokens"] > 0 and record["rollout_seconds"] > 0 and record["train_seconds"] > 0
    # A rerun finds every stage finished: nothing runs, the record stays.
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"a finished stage ran again: {a}"))
    assert run_onpolicy(config_for(distilled, f"onpolicy.out_dir={out}")) == [record]
    assert json.loads((out / "rounds.json").read_text()) == [record]


FEATURE = ["distill.draft_kind=feature", "distill.teacher=online", "distill.feature_layers=[0,1]",
           "distill.vocab_subset=192", "distill.feature_batch_tokens=60"]


def test_a_feature_drafts_round_trains_on_its_block_rollouts(tmp_path):
    """Round 1 of a feature draft: its rollouts (k guesses at a time from the target's states) keep the target's
    states, and training goes on from that feature draft on the mixture."""
    from accelerate.state import AcceleratorState

    generate(config_for(tmp_path, *FEATURE))
    AcceleratorState._reset_state(True)
    train(config_for(tmp_path, *FEATURE))
    out = tmp_path / "onpolicy"
    (record,) = run_onpolicy(config_for(tmp_path, *FEATURE, f"onpolicy.out_dir={out}", "generate.rollout_k=2"))
    draft = str(tmp_path / "run" / "final")
    assert record["draft"] == draft and record["draft_hash"] == model_hash(draft) and record["rollout_tokens"] > 0
    rollouts = out / "round-1" / "rollouts"
    plan = json.loads((rollouts / "plan.json").read_text())
    assert plan["rollout_draft_hash"] == model_hash(draft) and plan["sampler"] == "feature-rollout-v1:k=2"
    assert (rollouts / "features" / "features.json").is_file()
    trained = load_config(out / "round-1" / "train.yaml")
    assert trained.distill.init == draft and trained.distill.data_dirs == [str(tmp_path / "data"), str(rollouts)]
    assert (out / "round-1" / "run" / "final" / "feature_draft.json").is_file() and 0 < record["alpha"] <= 1


def test_the_mixture_gives_the_rollouts_their_weight():
    config = load_config(ROOT / "configs/tiny.yaml", ["distill.data_dirs=[a, b]", "distill.data_weights=[0.6, 0.2]",
                                                      "onpolicy.weight=0.5"])
    assert mixture_weights(config, 2) == pytest.approx([0.375, 0.125, 0.25, 0.25])


@pytest.mark.parametrize("overrides, error", [
    (["distill.out_dir={tmp}/nothing"],
     r"round 1 starts from the draft `make distill` writes to .*run `make distill` first"),
    (["distill.draft_kind=feature", "distill.teacher=online", "distill.out_dir={tmp}/nothing"],
     r"round 1 starts from .*feature draft folder .* does not exist"),
    (["generate.teacher_topk=0"], "set generate.teacher_topk >= 1"),
    (["onpolicy.weight=1.5"], r"onpolicy.weight: 1.5 is outside \[0, 1\]"),
    (["onpolicy.rounds=0"], "onpolicy.rounds must be >= 1"),
])
def test_bad_onpolicy_settings_stop_before_any_stage(tmp_path, monkeypatch, overrides, error):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a stage ran"))
    with pytest.raises(ConfigError, match=error):
        run_onpolicy(config_for(tmp_path, f"onpolicy.out_dir={tmp_path}/op",
                                *[o.format(tmp=tmp_path) for o in overrides]))
    assert not (tmp_path / "op" / "rounds.json").exists()


def test_a_failed_stage_is_one_error_that_says_how_to_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 3))
    with pytest.raises(onpolicy.StageFailed, match="exited with code 3 .* rerun `make onpolicy` to resume"):
        onpolicy.run_stage("distill.generate", config_for(tmp_path), tmp_path / "generate.yaml")
