"""RELIABILITY 12, 23: configuration errors are clear and happen before any model loads."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from common import precision
from common.cli import run_cli
from common.config import ConfigError, load_config
from common.errors import UserError
from common.models import torch_dtype
from common.sampling import SamplingParams
from tests.conftest import run_as_main


ROOT = Path(__file__).parents[1]

TINY = "configs/tiny.yaml"


def test_tiny_and_default_configs_load():
    cfg = load_config(TINY)
    assert cfg.target == "tiny:target" and cfg.eval.ks
    assert load_config("configs/smollm2.yaml").target == "embedded:smollm2-135m-instruct"


# fsdp.yaml is accelerate's launch config and demo-recipes.yaml make demo's table (tests/test_demo_recipe.py),
# not stage configs.
STAGE_CONFIGS = sorted(str(p) for p in (Path(__file__).parents[1] / "configs").glob("*.yaml")
                       if p.name not in ("fsdp.yaml", "demo-recipes.yaml"))


@pytest.mark.parametrize("path", STAGE_CONFIGS)
def test_every_shipped_stage_config_loads(path):
    """Typos or wrong types in a shipped preset fail here, not an hour into someone's run."""
    cfg = load_config(path)
    assert cfg.name and cfg.target and cfg.eval.ks


def test_overrides_are_typed_and_nested():
    cfg = load_config(TINY, ["eval.ks=[1,3]", "seed=7", "generate.temperature=1", "eval.out_dir=/tmp/x"])
    assert cfg.eval.ks == [1, 3] and cfg.seed == 7 and cfg.eval.out_dir == "/tmp/x"
    assert isinstance(cfg.generate.temperature, float)


def test_floats_in_exponent_form_without_a_dot_are_floats():
    """YAML 1.1 reads 1e-4 as a string; a float setting takes it as the number it means."""
    cfg = load_config(TINY, ["distill.lr=1e-4", "distill.weight_decay=5E-2"])
    assert cfg.distill.lr == 1e-4 and cfg.distill.weight_decay == 0.05
    with pytest.raises(ConfigError, match="distill.lr: expected float, got str '1e-4x'"):
        load_config(TINY, ["distill.lr=1e-4x"])


def test_a_mapping_given_whole_replaces_a_setting_and_merges_into_a_section():
    preset = ROOT / "configs/smollm2.yaml"  # distill.loss: {forward_kl: 1.0}
    assert load_config(preset, ["distill.loss={tvd: 1.0}"]).distill.loss == {"tvd": 1.0}
    assert load_config(preset, ["distill.loss.tvd=0.5"]).distill.loss == {"forward_kl": 1.0, "tvd": 0.5}
    cfg = load_config(preset, ["generate.vllm.llm_args={a: 1}", "generate.vllm.llm_args.b=2", "distill={lr: 0.01}"])
    assert cfg.generate.vllm.llm_args == {"a": 1, "b": 2}
    # a section given whole still merges: the preset's other distill keys stay
    assert cfg.distill.lr == 0.01 and cfg.distill.max_steps == load_config(preset).distill.max_steps > 0


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
    ("eval.top_p=0", r"eval.top_p: top_p must be in \(0, 1\]"),
    ("generate.top_p=1.5", r"generate.top_p: top_p must be in \(0, 1\]"),
    ("generate.top_k=-2", "generate.top_k: top_k must be >= 0"),
    ("eval.max_new_tokens=0", "max_new_tokens must be >= 1"),
    # Empty sweeps used to fail with max() of nothing / IndexError after the models had loaded.
    ("eval.num_prompts=0", "eval.num_prompts must be >= 1"),
    ("eval.ks=[]", "eval.ks is empty"),
    ("eval.temperatures=[]", "eval.temperatures is empty"),
    ("eval.hf_ks=[]", "eval.hf_ks is empty"),
    ("eval.hf_ks=[0]", "eval.hf_ks: k=0"),
    ("eval.hf_prompts=-1", r"eval.hf_prompts must be >= 0 \(0: every prompt\)"),
    ("eval.prompts=[]", "eval.prompts is empty"),
    ("eval.prompts=[data:evl]", "names split 'evl'"),
    ("eval.dtype=float32", "eval.dtype: 'float32' is not one of 'auto', 'fp32', 'bf16'"),
    # Moved from distill/generate.py and distill/train.py into their sections.
    ("generate.dtype=bfloat16", "generate.dtype: 'bfloat16' is not one of 'auto', 'fp32', 'bf16' .did you mean 'bf16'"),
    ("generate.backend=graph", "generate.backend"),
    (("generate.mode=score", "generate.teacher_topk=0"), "teacher_topk must be >= 1 in score mode"),
    ("generate.eval_fraction=1", r"eval_fraction: 1.0 is outside \[0, 1\)"),
    ("distill.lora_rank=4", "lora_rank > 0 needs a pretrained"),
    ("distill.jsd_beta=1", r"jsd_beta=1.0 must be in \(0, 1\)"),
    ("distill.kd_temperature=0", "kd_temperature=0.0 must be > 0"),
    ("distill.loss={forward_kl: 0}", "weights must be >= 0 with at least one > 0"),
    ("distill.micro_batch_size=0", "distill.micro_batch_size must be >= 1"),
    ("distill.group_by_length=-1", r"distill.group_by_length=-1 must be >= 0"),
    ("distill.ttt_reach=true", "distill.ttt_reach weighs the unrolled steps of a feature draft"),
    ("distill.precision=bfloat16", "distill.precision"),
    ("distill.embed_init=zeros", "distill.embed_init"),
    ("distill.deepspeed_config=configs/no-such.json", "deepspeed_config: 'configs/no-such.json' does not exist"),
    ("distill.data_weights=[0.5, 0.5]", "2 weights for 1 distill.data_dirs"),
    ("distill.data_weights=[1.5]", r"data_weights: 1.5 \(for data/tiny\) is outside \[0, 1\]"),
    ("distill.data_weights=[0]", "data_weights are all 0"),
    # Across sections: generate-data with this config holds nothing out for 'data:eval'.
    ("generate.eval_fraction=0", "generate.eval_fraction=0 leaves empty"),
])
def test_impossible_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override] if isinstance(override, str) else list(override))


def test_problems_of_every_section_are_reported_together():
    with pytest.raises(ConfigError) as error:
        load_config(TINY, ["generate.top_p=0", "distill.kd_temperature=-1", "eval.ks=[]"])
    lines = str(error.value).splitlines()
    assert lines[0] == "invalid config:" and len(lines) == 4
    assert "generate.top_p" in lines[1] and "distill.kd_temperature" in lines[2] and "eval.ks is empty" in lines[3]


def test_hf_ks_may_be_empty_without_hf_baselines():
    assert load_config(TINY, ["eval.hf_ks=[]", "eval.hf_baselines=false"]).eval.hf_ks == []


def test_sampling_parameters_come_from_the_config():
    cfg = load_config(TINY, ["generate.temperature=0.5", "generate.top_k=7", "generate.top_p=0.9", "eval.top_k=3"])
    assert cfg.generate.sampling == SamplingParams(0.5, 7, 0.9)
    assert cfg.eval.sampling(0.0) == SamplingParams(0.0, 3, 1.0) and cfg.eval.sampling(0.0).greedy


def test_one_dtype_spelling(monkeypatch):
    assert load_config("configs/smollm2.yaml").generate.dtype == "auto"
    assert torch_dtype("fp32", "cuda") == torch.float32 and torch_dtype("bf16", "cpu") == torch.bfloat16
    monkeypatch.setattr(precision, "native_bf16", lambda device: (True, "native bf16 (test)"))
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    # HF forwards (the engines): fp32 on a CPU even with AMX, where the lean runner's batch-1 decoding is bf16.
    assert torch_dtype("auto", "cpu") == torch.float32 and torch_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert precision.resolve_decode_dtype("auto", "cpu").name == "bf16"


def test_missing_model_path_fails_before_loading(tmp_path):
    cfg = load_config(TINY, [f"draft={tmp_path}/no/such/draft"])
    with pytest.raises(ConfigError, match="draft: model path .* does not exist"):
        cfg.check_model_refs("target", "draft")
    cfg.check_model_refs("target")


def test_hub_id_is_refused_only_while_the_hub_is_offline(monkeypatch):
    """Offline, a hub id that is neither a local folder nor cached would end in retries and a long
    traceback; online it is left to from_pretrained (the tests never touch the network)."""
    cfg = load_config(TINY, ["target=no-such-org/no-such-model", "distill.init=no-such-org/other",
                             "distill.vocab_subset=0"])
    for switch in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        cfg.check_model_refs("target", "distill.init")  # online: nothing to say without asking the hub
        monkeypatch.setenv(switch, "1")
        with pytest.raises(ConfigError) as error:
            cfg.check_model_refs("target", "distill.init")
        assert str(error.value).splitlines() == [
            f"{key}: 'no-such-org/{name}' is not a local folder and the hub is offline (HF_HUB_OFFLINE or "
            "TRANSFORMERS_OFFLINE is set), nor is it in the Hugging Face cache"
            for key, name in (("target", "no-such-model"), ("distill.init", "other"))]


@pytest.mark.parametrize("ref, message", [
    ("tiny:targte", "unknown tiny model 'tiny:targte'"),
    ("embedded:smollm2", "unknown embedded model 'embedded:smollm2'"),
])
def test_unknown_builtin_model_names(ref, message):
    with pytest.raises(ConfigError, match=f"target: {message}"):
        load_config(TINY, [f"target={ref}"]).check_model_refs("target")


def test_incomplete_model_folders_are_named(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    cfg = load_config(TINY, [f"draft={run}"])
    with pytest.raises(ConfigError, match=r"has no config.json; did you mean '.*run/final'"):
        cfg.check_model_refs("draft")
    cfg = load_config(TINY, [f"draft={run / 'final'}"])
    with pytest.raises(ConfigError, match="has no tokenizer files"):
        cfg.check_model_refs("draft")
    (run / "final" / "tokenizer.json").write_text("{}")
    cfg.check_model_refs("draft")


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_empty_config_file_is_an_error_not_all_defaults(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="config file .*empty.yaml' is empty"):
        load_config(path)


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\neval:\n  ks: [2, 4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml' is not valid YAML .*line \d+"):
        load_config(path)
    with pytest.raises(ConfigError, match="override 'eval.ks=\\[2,': .*not valid YAML"):
        load_config(TINY, ["eval.ks=[2,"])


def test_param_ratio_outside_usual_range_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(TINY, ["distill.param_ratio=0.2"])
    assert any("outside the usual 1-3%" in str(w.message) for w in caught)


def test_cli_reports_config_errors_cleanly(capsys):
    from decode.bench import main

    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, ["--config", TINY, "eval.ks=[0]"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: invalid config:\n  eval.ks: k=0")


@pytest.mark.parametrize("module, args", [
    ("distill.train", []), ("distill.generate", []), ("decode.bench", []), ("distill.features", []),
    ("distill.onpolicy", []), ("distill.held_out", ["--drafts", "runs/x/final"]),
])
def test_every_stage_reports_a_bad_setting_before_loading_its_stack(module, args):
    """The check takes the config alone (torch), not the stage's transformers and accelerate (~8 s in all)."""
    code = (f"import sys\nfrom common.cli import run_cli\nfrom {module} import main\ntry:\n"
            f"    run_cli(main, {args!r} + ['--config', {str(TINY)!r}, 'distill.lr=abc'])\n"
            "except SystemExit as e:\n    print(e.code, 'transformers' in sys.modules, 'accelerate' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["2", "False", "False"], out.stdout + out.stderr
    assert out.stderr == "error: distill.lr: expected float, got str 'abc'\n"


def test_run_cli_keeps_tracebacks_for_bugs(capsys):
    def user_mistake(argv):
        raise UserError("the file x is missing")

    def bug(argv):
        raise KeyError("oops")

    with pytest.raises(SystemExit) as exit_info:
        run_cli(user_mistake, [])
    assert exit_info.value.code == 2 and capsys.readouterr().err == "error: the file x is missing\n"
    with pytest.raises(KeyError):
        run_cli(bug, [])


@pytest.mark.parametrize("module, args", [
    ("decode.bench", []),
    ("distill.train", ["distill.data_dirs=[no/such/data]"]),
    ("distill.generate", []),
])
def test_entry_points_report_a_mistyped_target_in_one_line(module, args, tmp_path, capsys):
    """Every entry point (`python -m module`, run as __main__ in this process) refuses a mistyped target
    before loading anything: `error:` and exit 2."""
    stderr = run_as_main(module, "--config", TINY, f"target={tmp_path}/no-such-target",
                         f"generate.out_dir={tmp_path}/data", f"distill.out_dir={tmp_path}/run", *args, capsys=capsys)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: target: model path '{tmp_path}/no-such-target' does not exist"], stderr

