"""Generate mode with generate.features: the sampling runner keeps the feature draft's stored states as it
samples. The tokens must not change, every row's states must be those of a teacher-forced forward over its
prompt + completion (the last token's included), the folder must be what `make features` would have made, a
folder generated without them gets them on resume, and bad settings fail before any model loads. CPU, seconds."""

import json
import shutil

import pytest
import torch

from common.config import ConfigError, load_config
from common.models import load_model, model_hash
from common.sampling import SamplingParams
from decode.runners import make_batched_runner
from decode.runners.batched import LeanBatchedRunner
from distill.feature_store import FeatureSpec, features_dir, is_current, shard_digests
from distill.features import main as store_features
from distill.generation.batched_loop import generate_batch
from distill.generation.run import run
from distill.training.feature_stored import StoredFeatures
from distill.training.feature_teacher import forward_keeping_layers
from distill.generation.plan import ResumeMismatch
from tests.conftest import random_feature_draft, small_llama
from tests.test_feature_stored import BF16_TOLERANCE
from tests.test_feature_training import ROOT
from tests.test_scored_features import shard_rows, stored_states


pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = (0, 2)  # a middle layer and the last one (kept after the final norm)


def sample(runner, prompts, eos_ids):
    uniforms = torch.rand(len(prompts), 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return generate_batch(runner, prompts, uniforms, max_new_tokens=10, sampling=SamplingParams(1.0, 8),
                          eos_ids=eos_ids, teacher_topk=4)


def test_kept_states_are_the_teacher_forced_ones_and_change_no_token():
    # 16 tokens, three of them ending a row: rows end at different steps, so finished rows are compacted away
    # (each one step after its last token, whose states that step gives) while others run to the length cap.
    # Prompt 1 twice: its samples share one prefill.
    target = small_llama(layers=3, seed=4)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [8, 9], [10, 11, 12], [5], [6, 7, 8, 9, 10, 11], [12, 13], [14, 3, 4]]
    eos_ids = [1, 2, 15]
    plain = sample(LeanBatchedRunner(target), prompts, eos_ids)
    kept = sample(LeanBatchedRunner(target, hidden_layers=LAYERS), prompts, eos_ids)
    lengths = [len(c.completion_ids) for c in kept]
    assert len(set(lengths)) > 2 and max(lengths) == 10 and any(c.finish_reason == "eos" for c in kept)
    for prompt, a, b in zip(prompts, plain, kept, strict=True):
        assert a.completion_ids.tolist() == b.completion_ids.tolist() and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(b.topk_logprobs), torch.tensor(a.topk_logprobs), rtol=0, atol=1e-5)
        assert a.hidden is None
        sequence = prompt + b.completion_ids.tolist()
        with torch.no_grad():
            _, want = forward_keeping_layers(target.model, list(LAYERS), input_ids=torch.tensor([sequence]))
        assert b.hidden.dtype == torch.bfloat16 and b.hidden.shape == (len(sequence), len(LAYERS), 32)
        torch.testing.assert_close(b.hidden.float(), want[0], rtol=BF16_TOLERANCE,
                                   atol=BF16_TOLERANCE * float(want.abs().max()))


def test_only_the_lean_runner_keeps_states():
    with pytest.raises(ValueError, match="only the lean batched runner keeps hidden states"):
        make_batched_runner(small_llama(), "hf", hidden_layers=[0])


FEATURES = ["target=tiny:target", "generate.mode=generate", "generate.shard_size=4", "generate.batch_size=3",
            "generate.max_new_tokens=6", "generate.eval_fraction=0", "eval.prompts=[humaneval]", "wandb.mode=disabled",
            "distill.draft_kind=feature", "distill.teacher=stored", "distill.feature_layers=[0,1]",
            "distill.vocab_subset=192", "distill.feature_batch_tokens=60"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question {i}: " + "more words " * i}) + "\n" for i in range(10)))
    return path


def config(out, prompts, *overrides):
    return load_config(ROOT / "configs/tiny.yaml", [*FEATURES, f"generate.out_dir={out}",
                                                    f"generate.sources=[{prompts}]", f"distill.data_dirs=[{out}]",
                                                    *overrides])


def test_generated_folder_is_what_make_features_makes(prompts, tmp_path):
    kept, plain = tmp_path / "kept", tmp_path / "plain"
    run(config(kept, prompts, "generate.features=true"))
    run(config(plain, prompts))
    assert not features_dir(plain).exists()
    assert [(r["prompt_ids"], r["completion_ids"]) for r in shard_rows(kept)] == \
        [(r["prompt_ids"], r["completion_ids"]) for r in shard_rows(plain)]
    assert store_features(["--config", str(ROOT / "configs/tiny.yaml"), *FEATURES,
                           f"distill.data_dirs=[{plain}]"])["written"] == 3
    again = store_features(["--config", str(ROOT / "configs/tiny.yaml"), *FEATURES, f"distill.data_dirs=[{kept}]"])
    assert again == {**again, "written": 0, "skipped": 3}
    StoredFeatures([str(kept)], FeatureSpec.of(config(kept, prompts)))
    for a, b in zip(stored_states(kept), stored_states(plain), strict=True):
        assert a.shape == b.shape and a.shape[1:] == (2, 64)
        torch.testing.assert_close(a.float(), b.float(), rtol=BF16_TOLERANCE,
                                   atol=BF16_TOLERANCE * float(b.float().abs().max()))

    # A folder generated without features gets them when resumed with the option: the shards on disk by
    # `make features`' pass, the rest as they are sampled.
    resumed = tmp_path / "resumed"
    run(config(resumed, prompts, "generate.stop_after_shards=1"))
    manifest = run(config(resumed, prompts, "generate.features=true"))
    assert manifest["complete"] and len(manifest["shards"]) == 3
    assert all(is_current(path, digest) for path, digest in shard_digests(resumed).items())
    for a, b in zip(stored_states(resumed), stored_states(kept), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=BF16_TOLERANCE,
                                   atol=BF16_TOLERANCE * float(b.float().abs().max()))


def test_bad_settings_fail_before_any_model_loads(prompts, tmp_path):
    with pytest.raises(ConfigError, match="generate.features in generate mode keeps the lean runner's states"):
        config(tmp_path / "a", prompts, "generate.features=true", "generate.backend=hf").validate()


ROLLOUTS = ["generate.features=true", "generate.teacher_topk=4", "generate.dtype=fp32", "distill.precision=fp32"]


@pytest.fixture(scope="module")
def feature_draft(tmp_path_factory):
    """A feature draft of tiny:target reading the layers FEATURES stores."""
    folder = tmp_path_factory.mktemp("feature-draft")
    random_feature_draft(load_model("tiny:target"), target_layers=(0, 1)).save(folder)
    return folder


def test_a_feature_drafts_rollouts_keep_the_states_make_features_would_store(prompts, feature_draft, tmp_path):
    out, scored = tmp_path / "rollouts", tmp_path / "scored"
    manifest = run(config(out, prompts, *ROLLOUTS, f"generate.rollout_draft={feature_draft}"))
    recorded = manifest["fingerprint"]
    assert manifest["complete"] and recorded["rollout_draft_hash"] == model_hash(str(feature_draft))
    assert recorded["sampler"] == "feature-rollout-v1:k=4" and recorded == json.loads((out / "plan.json").read_text())
    assert all(is_current(path, digest) for path, digest in shard_digests(out).items())
    StoredFeatures([str(out)], FeatureSpec.of(config(out, prompts, *ROLLOUTS)))
    # `make features` over the same shards, copied without their states, stores what the rollouts kept.
    scored.mkdir()
    for path in out.iterdir():
        if path.is_file():
            shutil.copy(path, scored / path.name)
    assert store_features(["--config", str(ROOT / "configs/tiny.yaml"), *FEATURES, "distill.precision=fp32",
                           f"distill.data_dirs=[{scored}]"])["written"] == 3
    for a, b in zip(stored_states(out), stored_states(scored), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=BF16_TOLERANCE,
                                   atol=BF16_TOLERANCE * float(b.float().abs().max()))
    # A resume with another rollout draft is refused: the shards would mix two drafts' text.
    other = tmp_path / "other"
    random_feature_draft(load_model("tiny:target"), target_layers=(0, 1), seed=9).save(other)
    with pytest.raises(ResumeMismatch, match="rollout_draft"):
        run(config(out, prompts, *ROLLOUTS, f"generate.rollout_draft={other}"))


@pytest.mark.parametrize("overrides, error", [
    (["generate.features=false"], "is a feature draft, which trains on the target's states of its rollouts"),
    (["distill.feature_layers=[0]"], r"reads the target's layers \[0, 1\], generate.features keeps layers \[0\]"),
    (["generate.rollout_draft=tiny:draft"], "the standalone draft at generate.rollout_draft trains on tokens"),
    (["generate.rollout_draft={missing}"], "generate.rollout_draft: model path .* does not exist"),
])
def test_bad_rollouts_fail_before_any_shard(prompts, feature_draft, tmp_path, overrides, error):
    out = tmp_path / "rollouts"
    overrides = [o.format(missing=tmp_path / "missing") for o in overrides]
    with pytest.raises(ConfigError, match=error):
        run(config(out, prompts, *ROLLOUTS, f"generate.rollout_draft={feature_draft}", *overrides))
    assert not list(out.glob("shard-*"))
