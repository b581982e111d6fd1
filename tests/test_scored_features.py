"""Score mode with generate.features: the scoring forward also writes the feature draft's stored states. They
and the shards' top-k must equal what scoring alone and `make features` give, a folder scored without
features gets them on resume, and bad settings fail before any model loads. tiny:target (2 layers, the
embedded tokenizer); CPU, seconds."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from common.config import ConfigError, load_config
from distill.data import DataError
from distill.feature_store import FeatureSpec, features_dir, is_current, shard_digests
from distill.features import main as store_features
from distill.generation.run import run
from distill.training.feature_stored import StoredFeatures
from tests.test_feature_stored import BF16_TOLERANCE
from tests.test_feature_training import ROOT


PAIRS = 11  # 3 shards of 4, the last one short
FEATURES = ["target=tiny:target", "generate.mode=score", "generate.response_field=response", "generate.shard_size=4",
            "generate.batch_size=3", "generate.eval_fraction=0", "eval.prompts=[humaneval]", "wandb.mode=disabled", "distill.draft_kind=feature",
            "distill.teacher=stored", "distill.feature_layers=[0,1]", "distill.vocab_subset=192",
            "distill.feature_batch_tokens=60"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(prompt, response) pairs of different lengths, so forwards sort and cut them by the position budget."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question {i}?", "response": f"Answer {i}: " + "more words " * i})
                            + "\n" for i in range(PAIRS)))
    return path


def config(out, pairs, *overrides):
    return load_config(ROOT / "configs/tiny.yaml", [*FEATURES, f"generate.out_dir={out}", f"generate.sources=[{pairs}]",
                                                    f"distill.data_dirs=[{out}]", *overrides])


def shard_rows(out) -> list[dict]:
    return [row for path in sorted(out.glob("shard-*.parquet")) for row in pq.read_table(path).to_pylist()]


def stored_states(out) -> list[torch.Tensor]:
    return [load_file(path)["hidden"] for path in sorted(features_dir(out).glob("shard-*.safetensors"))]


def test_one_forward_gives_the_scores_and_the_states_of_two_passes(pairs, tmp_path):
    fused, plain = tmp_path / "fused", tmp_path / "plain"
    run(config(fused, pairs, "generate.features=true"))
    run(config(plain, pairs))
    assert not features_dir(plain).exists()
    summary = store_features(["--config", str(ROOT / "configs/tiny.yaml"), *FEATURES, f"distill.data_dirs=[{plain}]"])
    assert summary["written"] == 3
    # Every shard of the fused folder has a current features file of the spec training asks for: `make features`
    # finds nothing to do, and the stored teacher opens them.
    spec = FeatureSpec.of(config(fused, pairs))
    assert all(is_current(path, digest) for path, digest in shard_digests(fused).items())
    again = store_features(["--config", str(ROOT / "configs/tiny.yaml"), *FEATURES, f"distill.data_dirs=[{fused}]"])
    assert again == {**again, "written": 0, "skipped": 3}
    StoredFeatures([str(fused)], spec)

    fused_rows, plain_rows = shard_rows(fused), shard_rows(plain)
    assert len(fused_rows) == PAIRS
    for a, b in zip(fused_rows, plain_rows, strict=True):
        assert (a["prompt_ids"], a["completion_ids"], a["finish_reason"]) == (b["prompt_ids"], b["completion_ids"],
                                                                             b["finish_reason"])
        # fp32 both ways: the decoder alone, right-padded, against the runner's left-padded prefill.
        torch.testing.assert_close(torch.tensor(a["teacher_topk_logprobs"]), torch.tensor(b["teacher_topk_logprobs"]),
                                   rtol=0, atol=1e-4)
        assert [ids[0] for ids in a["teacher_topk_ids"]] == [ids[0] for ids in b["teacher_topk_ids"]]
    for a, b in zip(stored_states(fused), stored_states(plain), strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape and a.shape[1:] == (2, 64)
        torch.testing.assert_close(a.float(), b.float(), rtol=BF16_TOLERANCE,
                                   atol=BF16_TOLERANCE * float(b.float().abs().max()))


def test_a_folder_scored_without_features_gets_them_when_resumed_with_them(pairs, tmp_path):
    out = tmp_path / "out"
    run(config(out, pairs, "generate.stop_after_shards=1"))
    manifest = run(config(out, pairs, "generate.features=true"))
    assert manifest["complete"] and len(manifest["shards"]) == 3
    assert all(is_current(path, digest) for path, digest in shard_digests(out).items())
    whole = tmp_path / "whole"
    run(config(whole, pairs, "generate.features=true"))
    for a, b in zip(stored_states(out), stored_states(whole), strict=True):  # the first made by the fill pass
        torch.testing.assert_close(a.float(), b.float(), rtol=BF16_TOLERANCE,
                                   atol=BF16_TOLERANCE * float(b.float().abs().max()))


def test_bad_settings_fail_before_any_model_loads(pairs, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="generate.features runs on the project engine"):
        config(tmp_path / "a", pairs, "generate.features=true", "generate.engine=vllm").validate()

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded before the settings were checked")

    monkeypatch.setattr("distill.generation.run.load_target", no_model)
    monkeypatch.setattr("distill.generation.run.load_runner", no_model)
    with pytest.raises(ConfigError, match=r"distill.precision \(bf16\); generate.dtype resolves to fp32"):
        run(config(tmp_path / "b", pairs, "generate.features=true", "distill.precision=bf16"))
    assert not (tmp_path / "b").exists()
    other = tmp_path / "c"
    FeatureSpec.of(config(other, pairs, "distill.feature_layers=[0]")).write(features_dir(other))
    with pytest.raises(DataError, match="other layers"):
        run(config(other, pairs, "generate.features=true"))
    assert list(other.iterdir()) == [features_dir(other)]
