"""The stored teacher of a feature draft (distill.teacher=stored, after `make features`): the stored hidden
states equal the online teacher's, its target_logp equals the online one when the top-K is the whole
vocabulary, training steps run without the target's forward (evaluations run it), and bad or missing features fail before any
step. The tiny target and helpers of tests/test_feature_training.py; CPU, seconds."""

import json
import subprocess

import pytest
import torch

from common.config import ConfigError, load_config
from common.models import load_model
from distill.data import DataError, collate, load_examples
from distill.feature_store import FeatureSpec, features_dir, forward_batches
from distill.features import main as store_features
from distill.training.feature import FeatureRecipe
from distill.training.feature_stored import StoredFeatures, StoredFeatureTeacher, topk_subset_logp
from distill.training.feature_teacher import FeatureTeacher
from tests.synthetic_shards import write_scored_shards
from tests.test_feature_training import FEATURE, ROOT, feature_config, rows, run, save_target


STORED = ["distill.teacher=stored"]
# Both sides run the target in bf16, batched differently (padding, batch shape): a couple of bf16 ulps of
# the largest value, which is what a residual stream's sums lose (a wrong slice misses by the whole scale).
BF16_TOLERANCE = 2 ** -6
SHORT = 8  # distill.max_seq_len that cuts some rows' prompts (their oldest tokens) and others' completions

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:the feature draft has .* of the target's parameters")]


def store(target_dir, data, *overrides) -> dict:
    """`make features` in-process, as the Makefile runs it."""
    return store_features(["--config", str(ROOT / "configs/tiny.yaml"), f"target={target_dir}",
                           f"distill.data_dirs=[{data}]", *FEATURE, *STORED, *overrides])


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def data(target_dir, tmp_path_factory):
    """test_feature_training's shards, with one-token prompts too (only their completions can be cut),
    features stored."""
    data_dir = write_scored_shards(tmp_path_factory.mktemp("data"), load_model(str(target_dir)), prompt_len=(1, 10))
    # The target in bf16, as the online teacher below; forwards of a few rows each, cut by the position budget.
    store(target_dir, data_dir, "distill.precision=bf16", "distill.feature_batch_tokens=40")
    return data_dir


def examples(target_dir, data, max_seq_len):
    """(a stored-teacher config, every train and held-out example of `data` cut to max_seq_len)."""
    config = feature_config(target_dir, data, "unused", *STORED, f"distill.max_seq_len={max_seq_len}")
    train, held_out = load_examples([str(data)], max_seq_len, need_topk=True)
    return config, train + held_out


def online_hidden(target, batch) -> torch.Tensor:
    teacher = FeatureTeacher(target, [0, 2], torch.arange(target.config.vocab_size), torch.float32)
    return teacher(batch).hidden


def test_stored_hidden_states_equal_the_online_teachers(target_dir, data):
    config, short = examples(target_dir, data, SHORT)
    _, whole = examples(target_dir, data, 512)
    assert any(ex.origin[2] > 0 for ex in short)  # some prompts lost their oldest tokens
    assert any(ex.origin[2] == 0 and len(ex.ids) < len(w.ids) for ex, w in zip(short, whole))  # some completions cut
    stored = StoredFeatures([str(data)], FeatureSpec.of(config))
    target = load_model(str(target_dir)).to(torch.bfloat16)  # as the online teacher runs under precision=bf16
    batch = collate(short, 0, with_topk=True)
    hidden = stored.batch(short, batch["input_ids"].shape).float()
    online_short, online_whole = online_hidden(target, batch), online_hidden(target, collate(whole, 0, True))
    close = dict(rtol=BF16_TOLERANCE, atol=BF16_TOLERANCE * float(online_whole.abs().max()))
    for b, (ex, full) in enumerate(zip(short, whole)):
        n, start = len(ex.ids) - 1, ex.origin[2]
        assert ex.origin[:2] == full.origin[:2]
        # The stored states saw the whole prompt: the online teacher's over the untruncated row, shifted.
        torch.testing.assert_close(hidden[b, :n], online_whole[b, start:start + n], **close)
        if start == 0:  # nothing before the window was cut: the online teacher's over the short row itself
            torch.testing.assert_close(hidden[b, :n], online_short[b, :n], **close)
        assert not hidden[b, n:].any()  # padding


def test_features_run_longest_rows_first_within_the_row_and_position_budgets():
    lengths = [5, 30, 12, 12, 7, 50, 3, 12]
    batches = forward_batches(lengths, max_rows=3, max_tokens=36)
    assert sorted(r for batch in batches for r in batch) == list(range(len(lengths)))  # each row once
    assert [lengths[r] for batch in batches for r in batch] == sorted(lengths, reverse=True)
    assert batches[0] == [5]  # longer than the budget: alone
    for batch in batches:
        assert len(batch) <= 3 and (len(batch) == 1 or len(batch) * lengths[batch[0]] <= 36)
    assert [len(b) for b in batches] == [1, 1, 3, 3]  # 30 alone (2 x 30 > 36); 12 x 3; then the row cap


def test_target_logp_from_a_full_vocabulary_top_k_equals_the_online_one(target_dir, tmp_path):
    target = load_model(str(target_dir))
    vocab = target.config.vocab_size
    data_dir = write_scored_shards(tmp_path, target, n_train=6, n_eval=0, topk=vocab)  # K = V
    batch = collate(load_examples([str(data_dir)], 512, need_topk=True)[0], 0, with_topk=True)
    batch["stored_hidden"] = torch.zeros(0)
    subset = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:192]
    online = FeatureTeacher(target, [0, 2], subset, torch.float32)(batch)
    stored = StoredFeatureTeacher(target.get_input_embeddings().weight, subset, torch.float32)(batch)
    assert torch.equal(stored.positions, online.positions) and torch.equal(stored.target_top1, online.target_top1)
    torch.testing.assert_close(stored.target_logp, online.target_logp, rtol=0, atol=1e-4)
    torch.testing.assert_close(stored.embeds, online.embeds)


def test_tokens_outside_the_top_k_share_the_rest_of_the_mass():
    ids, logp = torch.tensor([[3, 7]]), torch.tensor([[0.5, 0.3]]).log()  # V = 10, K = 2: rest 0.2 over 8
    subset = torch.tensor([7, 5, 3])
    assert topk_subset_logp(ids, logp, subset, 10).exp().tolist()[0] == pytest.approx([0.3, 0.025, 0.5])


def test_training_with_stored_features_runs_the_target_only_to_evaluate(target_dir, data, tmp_path, monkeypatch):
    """The target's forward runs in held-out evaluations (exact α) and never in a training step."""
    evaluating = []
    forward = type(load_model(str(target_dir))).forward

    def only_in_evaluations(*args, **kwargs):
        assert evaluating, "the target ran forward in a training step under distill.teacher=stored"
        return forward(*args, **kwargs)

    held_out_metrics = FeatureRecipe.held_out_metrics

    def evaluate(self):
        evaluating.append(True)
        try:
            return held_out_metrics(self)
        finally:
            evaluating.pop()

    monkeypatch.setattr(type(load_model(str(target_dir))), "forward", only_in_evaluations)
    monkeypatch.setattr(FeatureRecipe, "held_out_metrics", evaluate)
    summary = run(target_dir, data, tmp_path, *STORED, "distill.max_steps=16", "distill.eval_every=8",
                  "distill.lr=0.01", "distill.warmup_steps=2", "distill.early_stop_patience=0")
    losses = [r["train/loss"] for r in rows(tmp_path) if "train/loss" in r]
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    assert 0 < summary["final/alpha"] < 1 and "exact" in summary["alpha_note"]
    assert [r["step"] for r in rows(tmp_path) if "eval/alpha" in r] == [8, 16]
    assert json.loads((tmp_path / "final_metrics.json").read_text())["teacher"] == "stored"


def test_missing_or_mismatched_features_fail_before_training(target_dir, data, tmp_path):
    with pytest.raises(ConfigError, match="set distill.draft_kind=feature"):
        load_config(None, STORED)
    bare = write_scored_shards(tmp_path / "bare", load_model(str(target_dir)), n_train=4, n_eval=0)
    with pytest.raises(DataError, match=r"no stored features .*run `make features`"):
        run(target_dir, bare, tmp_path / "run", *STORED)
    with pytest.raises(DataError, match=r"other layers \(layers \[0, 2\] -> \[0, 1\]\).*`make features`"):
        run(target_dir, data, tmp_path / "run", *STORED, "distill.feature_layers=[0,1]")
    other = save_target(tmp_path / "other", hidden=32)
    with pytest.raises(DataError, match=r"another target .*hidden_size.*`make features`"):
        run(other, data, tmp_path / "run", *STORED)
    store(target_dir, bare)
    next(features_dir(bare).glob("*.safetensors")).unlink()
    with pytest.raises(DataError, match=r"shard-00000.safetensors is missing .*run `make features`"):
        run(target_dir, bare, tmp_path / "run", *STORED)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


def test_a_rerun_skips_complete_files_and_refuses_other_layers(target_dir, data, capsys):
    files = sorted(features_dir(data).glob("*.safetensors"))
    before = [f.stat().st_mtime_ns for f in files]
    summary = store(target_dir, data)
    assert summary["written"] == 0 and summary["skipped"] == len(files) == 2
    assert [f.stat().st_mtime_ns for f in files] == before
    tokens = sum(len(ex.ids) for ex in examples(target_dir, data, 512)[1])
    assert summary["bytes"] > tokens * 2 * 64 * 2  # tokens x 2 layers x width 64 x bf16
    assert "0.00 GB" in capsys.readouterr().out
    with pytest.raises(DataError, match="other layers.*`make features`"):
        store(target_dir, data, "distill.feature_layers=[0,1]")
    assert [f.stat().st_mtime_ns for f in files] == before


def test_make_demo_feature_runs_its_four_stages_in_order_on_the_feature_preset():
    # Each stage is tested on its own above and in test_feature_training.py; this is the wiring.
    result = subprocess.run(["make", "-n", "-o", ".venv/.installed", "demo-feature"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    stages = [line.split(" -m ")[1].split()[:3] for line in result.stdout.splitlines() if " -m " in line]
    assert stages == [[module, "--config", "configs/smollm2-feature.yaml"]
                      for module in ("distill.generate", "distill.features", "distill.train", "decode.bench")]
