"""RELIABILITY 12, 23: configuration errors are clear and happen before any model loads."""

import warnings
from pathlib import Path

import pytest

from decode.config import ConfigError, load_config

TINY = "configs/tiny.yaml"


def test_tiny_and_default_configs_load():
    cfg = load_config(TINY)
    assert cfg.target == "tiny:target" and cfg.eval.ks
    assert load_config("configs/smollm2.yaml").target == "embedded:smollm2-135m-instruct"


# fsdp.yaml is accelerate's launch config, not a stage config.
STAGE_CONFIGS = sorted(str(p) for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")
                       if p.name != "fsdp.yaml")


@pytest.mark.parametrize("path", STAGE_CONFIGS)
def test_every_shipped_stage_config_loads(path):
    """Typos or wrong types in a shipped preset fail here, not an hour into someone's run."""
    cfg = load_config(path)
    assert cfg.name and cfg.target and cfg.eval.ks


def test_overrides_are_typed_and_nested():
    cfg = load_config(TINY, ["eval.ks=[1,3]", "seed=7", "generate.temperature=1", "eval.out_dir=/tmp/x"])
    assert cfg.eval.ks == [1, 3] and cfg.seed == 7 and cfg.eval.out_dir == "/tmp/x"
    assert isinstance(cfg.generate.temperature, float)


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'eval.temperature'.*did you mean 'temperatures'"):
        load_config(TINY, ["eval.temperature=[0.5]"])
    with pytest.raises(ConfigError, match="unknown config key 'nmae'.*'name'"):
        load_config(TINY, ["nmae=x"])


@pytest.mark.parametrize("override, message", [
    ("eval.ks=[2, four]", r"eval.ks\[1\]: expected int"),
    ("seed=1.5", "seed: expected int"),
    ("eval.hf_baselines=maybe", "eval.hf_baselines: expected bool"),
    ("generate=3", "generate: expected a mapping"),
])
def test_wrong_types(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override])


@pytest.mark.parametrize("override, message", [
    ("eval.ks=[0, 2]", "k must be >= 1"),
    ("eval.ks=[-1]", "k must be >= 1"),
    ("eval.lookup_ngram=1", "lookup_ngram"),
    ("eval.temperatures=[-0.5]", "temperature must be >= 0"),
    ("generate.temperature=-1", "temperature must be >= 0"),
    ("eval.top_p=0", r"outside \(0, 1\]"),
    ("generate.top_p=1.5", r"outside \(0, 1\]"),
    ("eval.max_new_tokens=0", "max_new_tokens must be >= 1"),
])
def test_impossible_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override])


def test_missing_model_path_fails_before_loading(tmp_path):
    cfg = load_config(TINY, [f"draft={tmp_path}/no/such/draft"])
    with pytest.raises(ConfigError, match="model path .* does not exist"):
        cfg.check_model_refs("target", "draft")
    cfg = load_config(TINY, ["draft=HuggingFaceTB/SmolLM2-135M"])  # a hub id is not a local path
    cfg.check_model_refs("draft")


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_param_ratio_outside_usual_range_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(TINY, ["distill.param_ratio=0.2"])
    assert any("outside the usual 1-3%" in str(w.message) for w in caught)


def test_cli_reports_config_errors_cleanly(capsys):
    from decode.bench import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", TINY, "eval.ks=[0]"])
    assert exit_info.value.code == 2
    assert "k must be >= 1" in capsys.readouterr().err
