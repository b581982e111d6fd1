"""Training a feature draft (distill.draft_kind=feature): it learns, unrolled steps are masked where they
have no context, the head starts from the target's rows, final/ round-trips, bad input fails early,
resume matches a straight run. A tiny random target (peaked distributions), CPU, seconds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.config import ConfigError, load_config
from common.errors import UserError
from common.models import load_model, load_tokenizer
from decode.drafts.feature.model import FeatureDraft, is_feature_draft
from decode.drafts.feature.shape import build_feature_draft, choose_feature_shape
from distill.checkpoint import latest_checkpoint
from distill.held_out import main as held_out_main
from distill.train import train
from distill.training.feature import FeatureRecipe
from distill.training.feature_eval import tau_from_step_alphas
from distill.training.feature_loss import reach_weights
from distill.training.feature_teacher import step_masks
from tests.conftest import small_llama
from tests.synthetic_shards import write_scored_shards
from tests.test_train import SPLIT, assert_same_tensors


ROOT = Path(__file__).resolve().parents[1]
# Explicit sizes: the tiny target is too small for a feature draft within 3% (its width alone fixes more).
FEATURE = ["distill.draft_kind=feature", "distill.teacher=online", "distill.feature_layers=[0,2]",
           "distill.vocab_subset=192", "distill.feature_intermediate_size=64", "distill.ttt_steps=3",
           "distill.eval_samples=8"]

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:the feature draft has .* of the target's parameters")]


def save_target(path: Path, **shape) -> Path:
    """A tiny random Llama (1,024-token vocabulary, peaked distributions) with the embedded tokenizer."""
    small_llama(**{"vocab_size": 1024, "hidden": 64, "layers": 3, "init_std": 0.3, **shape}).save_pretrained(path)
    load_tokenizer("tiny:target").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def data(target_dir, tmp_path_factory):
    """24 train + 8 eval rows of random tokens from a 401-token pool (233 distinct ones in the train rows)."""
    return write_scored_shards(tmp_path_factory.mktemp("data"), load_model(str(target_dir)))


def feature_config(target_dir, data, out, *overrides):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # each run builds its own Accelerator
    return load_config(ROOT / "configs/tiny.yaml", [f"target={target_dir}", f"distill.data_dirs=[{data}]",
                                                    f"distill.out_dir={out}", "wandb.mode=disabled", *FEATURE,
                                                    *overrides])


def run(target_dir, data, out, *overrides):
    return train(feature_config(target_dir, data, out, *overrides))


def rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_the_draft_learns_on_a_tiny_target(target_dir, data, tmp_path):
    summary = run(target_dir, data, tmp_path, "distill.max_steps=24", "distill.eval_every=6", "distill.lr=0.01",
                  "distill.warmup_steps=2", "distill.early_stop_patience=0")
    evals = [r for r in rows(tmp_path) if "eval/alpha" in r]
    losses = [r["train/loss"] for r in rows(tmp_path) if "train/loss" in r]
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses
    # Random token sequences: held-out gains are small, but the KL must fall and α rise.
    assert evals[-1]["eval/kl"] < 0.85 * evals[0]["eval/kl"] and evals[-1]["eval/alpha"] > evals[0]["eval/alpha"], evals
    for j in range(4):  # every step up to τ's k = 4 is measured, exact (online teacher) and a probability
        assert 0 < evals[-1][f"eval/alpha_step{j}"] < 1
    alphas = [evals[-1][f"eval/alpha_step{j}"] for j in range(4)]
    assert summary["final/tau_k4"] == pytest.approx(tau_from_step_alphas(alphas, 4))
    assert summary["final/alpha"] == max(r["eval/alpha"] for r in evals)  # final/ is the best evaluation


def test_step_masks_leave_out_positions_without_context():
    positions = torch.tensor([[True, True, True, False], [False, True, True, True]])
    masks = step_masks(positions, 3)
    assert masks[0].tolist() == positions.tolist()
    assert masks[1].tolist() == [[False, True, True, False], [False, True, True, True]]
    assert masks[2].tolist() == [[False, False, True, False], [False, False, True, True]]


@pytest.mark.parametrize("reach", [False, True])
def test_unrolled_loss_counts_step_j_only_from_position_j(target_dir, data, tmp_path, reach):
    """A one-token prompt puts draft positions at i = 0, 1, 2: step 1 may use i >= 1 and step 2 only i = 2.
    The recipe's loss must equal Σ_j 0.8^j Σ_{i >= j} w_ij m_i KL(p̂_i ‖ draft_ij), computed here from scratch:
    w_ij = 1, or with distill.ttt_reach the product of Σ min(p, q) at the block's earlier steps
    (step m at i - j + m)."""
    recipe = FeatureRecipe(feature_config(target_dir, data, tmp_path, f"distill.ttt_reach={str(reach).lower()}"))
    assert recipe.setup()
    ids = torch.tensor([[400, 401, 402, 403, 404]])  # prompt [400], completion [401..404]
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "attention_mask": torch.ones(1, 4, dtype=torch.long),
             "loss_mask": torch.ones(1, 4, dtype=torch.bool)}
    loss, _, _, finite = recipe.micro_batch_loss(batch)
    assert finite and recipe.loss_tokens(batch) == 3

    target, draft = recipe.teacher.target, recipe.model.draft
    with torch.no_grad():
        out = target(input_ids=batch["input_ids"], output_hidden_states=True)
        hidden = torch.stack([out.hidden_states[i + 1] for i in (0, 2)], dim=2)
        target_probs = torch.softmax(out.logits[0], -1)[:, recipe.subset.ids]  # [4, N]
        outs = draft.unrolled(hidden, target.get_input_embeddings()(batch["labels"]), 3)
        draft_probs = [torch.softmax(draft.logits(step_out[0]), -1) for step_out in outs]  # [4, N] per step
        expected = 0.0
        for j in range(3):
            for i in range(j, 3):  # draft position i is taught by the target at i + 1
                mass = target_probs[i + 1].sum()
                p_hat = target_probs[i + 1] / mass
                reach_ij = 1.0
                for m in range(j) if reach else ():
                    reach_ij *= torch.minimum(draft_probs[m][i - j + m], target_probs[i - j + m + 1]).sum()
                expected += 0.8 ** j * reach_ij * mass * (p_hat * (p_hat.log() - draft_probs[j][i].log())).sum()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-4)


def test_reach_weights_multiply_the_blocks_earlier_acceptance():
    """Step j at position i belongs to the block whose step m sits at i - j + m; a position without a
    teacher (the prompt) counts as accepted, and a rejected step 0 leaves its block's later steps nothing."""
    positions = torch.tensor([[False, True, True, True, True]])
    masks = step_masks(positions, 3)
    alphas = [torch.tensor([0.5, 0.0, 0.8, 0.9]), torch.tensor([0.6, 0.7, 0.4, 0.1]), torch.tensor([0.3, 0.2, 0.9])]
    reach = reach_weights(masks, alphas)
    assert reach[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    # Step 1 at i = 1..4: step 0 at i - 1 (i = 1: the prompt position, no teacher).
    assert reach[1].tolist() == pytest.approx([1.0, 0.5, 0.0, 0.8])
    # Step 2 at i = 2..4: step 0 at i - 2 and step 1 at i - 1.
    assert reach[2].tolist() == pytest.approx([1.0 * 0.6, 0.5 * 0.7, 0.0 * 0.4])
    # A batch shorter than the steps (one position): no earlier step exists, nothing is indexed out of range.
    short = step_masks(torch.tensor([[True]]), 3)
    assert [r.tolist() for r in reach_weights(short, [torch.tensor([0.5]), torch.zeros(0), torch.zeros(0)])] == \
        [[1.0], [], []]


def test_head_starts_from_the_target_rows_of_the_subset(target_dir):
    target = load_model(str(target_dir))
    config, shape = choose_feature_shape(target.config, 10**7, 0.03, [0, 2], head_rows=64, intermediate_size=32)
    ids = torch.arange(300, 364)
    from_target = build_feature_draft(target, config, ids, "target", seed=0)
    assert torch.equal(from_target.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(from_target.norm.weight, target.model.norm.weight)
    random = build_feature_draft(target, config, ids, "random", seed=0)
    assert not torch.equal(random.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(random.fc.weight, from_target.fc.weight)  # the rest is the same seeded init


def test_shape_fits_the_parameter_ratio_and_says_when_it_cannot():
    target_config = load_model("tiny:target").config  # width 64, 2 layers, 3.2M params
    config, shape = choose_feature_shape(target_config, 3_200_000, 0.03, [0, 1])
    assert shape.params <= 0.03 * 3_200_000 and shape.ratio > 0.028  # fills the budget from below
    assert shape.head_rows % 64 == 0 and config.draft_vocab_size == shape.head_rows
    with pytest.raises(ConfigError, match=r"param_ratio=0.005: .* fixed params"):
        choose_feature_shape(target_config, 3_200_000, 0.005, [0, 1])


def test_final_round_trips_the_trained_draft(target_dir, data, tmp_path):
    # No evaluation before the end: the last step is the best one, so final/ holds the last weights.
    run(target_dir, data, tmp_path, "distill.max_steps=3", "distill.eval_every=0", "distill.save_every=0")
    final = tmp_path / "final"
    assert is_feature_draft(final)
    for name in ("config.yaml", "metrics.json", "tokenizer.json"):
        assert (final / name).is_file()
    loaded = FeatureDraft.load(final)
    trained = load_file(latest_checkpoint(tmp_path) / "model.safetensors")
    state = loaded.state_dict()
    assert set(state) == {name.removeprefix("draft.") for name in trained}
    for name, tensor in state.items():
        assert torch.equal(tensor, trained[f"draft.{name}"]), name
    eos = load_tokenizer(str(target_dir)).eos_token_id
    assert eos in loaded.draft_ids.tolist() and loaded.config.target_layers == [0, 2]
    assert loaded.num_params() == sum(t.numel() for n, t in trained.items() if n != "draft.draft_ids")


def test_the_run_ends_with_an_eagle3_export_when_engines_can_load_it(target_dir, data, tmp_path, capsys):
    steps = ["distill.max_steps=1", "distill.eval_every=0", "distill.save_every=0"]
    run(target_dir, data, tmp_path / "mid", *steps, "distill.feature_layers=[0,1]")
    config = json.loads((tmp_path / "mid" / "export" / "eagle3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    capsys.readouterr()
    # Layer 2 is the last of 3, which engines read after the final norm: skipped, said why, final/ kept.
    run(target_dir, data, tmp_path / "last", *steps)
    printed = capsys.readouterr().out
    assert "export eagle3 skipped" in printed and "last layer (2)" in printed
    assert is_feature_draft(tmp_path / "last" / "final") and not (tmp_path / "last" / "export").exists()


def test_config_errors(target_dir, data, tmp_path):
    with pytest.raises(ConfigError, match="set distill.teacher=online"):
        load_config(None, ["distill.draft_kind=feature"])
    with pytest.raises(ConfigError, match="did you mean 'feature'"):
        load_config(None, ["distill.draft_kind=featur"])
    with pytest.raises(ConfigError, match=r"'ce' needs a head row"):
        load_config(None, ["distill.draft_kind=feature", "distill.teacher=online", "distill.loss={ce: 1.0}"])
    with pytest.raises(ConfigError, match="distinct 0-based"):
        load_config(None, ["distill.draft_kind=feature", "distill.teacher=online", "distill.feature_layers=[1,1]"])
    # Layers the target lacks fail before the data is read (a missing data folder would fail otherwise).
    with pytest.raises(ConfigError, match=r"feature_layers=\[0, 3\]: the target .* has 3 decoder layers \(0..2\)"):
        run(target_dir, tmp_path / "no-data", tmp_path / "run", "distill.feature_layers=[0,3]")
    with pytest.raises(ConfigError, match=r"default feature layers \[1, 0, -1\].*has 3 decoder layers"):
        run(target_dir, tmp_path / "no-data", tmp_path / "run", "distill.feature_layers=[]")


@pytest.mark.parametrize("deepspeed", [False, True], ids=["ddp", "deepspeed-zero2"])
def test_two_ranks_equal_one_process(target_dir, data, tmp_path, deepspeed):
    """DDP (or DeepSpeed ZeRO-2) over the unrolled draft (its forward is the module's): 2 ranks x 2
    micro-batches of 2 = 1 x 8."""
    if deepspeed:
        pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install '.[deepspeed]')")
    steps = ["distill.max_steps=3", "distill.eval_every=0", "distill.save_every=0"]
    run(target_dir, data, tmp_path / "one", "distill.micro_batch_size=8", *steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    overrides = [f"target={target_dir}", f"distill.data_dirs=[{data}]", f"distill.out_dir={tmp_path / 'two'}",
                 "wandb.mode=disabled", *FEATURE, "distill.micro_batch_size=2", "distill.grad_accum=2", *steps]
    if deepspeed:
        overrides.append("distill.deepspeed_config=configs/deepspeed_zero2.json")
    result = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
                             "-m", "distill.train", "--config", "configs/tiny.yaml", *overrides],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    one, two = (load_file(tmp_path / name / "final/model.safetensors") for name in ("one", "two"))
    assert_same_tensors(one, two, **SPLIT)  # splitting a step changes only the summation order
    losses = [[r["train/loss"] for r in rows(tmp_path / name) if "train/loss" in r] for name in ("one", "two")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_resume_matches_a_straight_run(target_dir, data, tmp_path):
    common = ["distill.max_steps=6", "distill.eval_every=3", "distill.save_every=0"]
    run(target_dir, data, tmp_path / "straight", *common)
    assert run(target_dir, data, tmp_path / "resumed", *common, "distill.stop_after=2")["stopped"] == "interrupted"
    run(target_dir, data, tmp_path / "resumed", *common)
    runs = [tmp_path / "straight", tmp_path / "resumed"]
    a, b = (load_file(run_dir / "checkpoints/step-6/model.safetensors") for run_dir in runs)
    assert all(torch.equal(a[name], b[name]) for name in a)
    losses = [[r["train/loss"] for r in rows(run_dir) if "train/loss" in r] for run_dir in runs]
    assert losses[0] == losses[1]  # the same data order, bit for bit


@pytest.mark.parametrize("change", ["hidden", "layers", "tokenizer"])
def test_resume_against_a_different_target_is_refused(data, tmp_path, change):
    target_dir = save_target(tmp_path / "target")
    run(target_dir, data, tmp_path / "run", "distill.max_steps=4", "distill.stop_after=1", "distill.eval_every=0")
    if change == "tokenizer":  # same model, a tokenizer with one more token: ids may mean other things
        tokenizer = load_tokenizer(str(target_dir))
        tokenizer.add_tokens(["<an-extra-token>"])
        tokenizer.save_pretrained(target_dir)
        expected = "tokenizer_sha256"
    else:
        save_target(target_dir, **({"hidden": 32} if change == "hidden" else {"layers": 4}))
        expected = "hidden_size 64 -> 32" if change == "hidden" else "num_hidden_layers 3 -> 4"
    with pytest.raises(ConfigError, match=f"trained against a different target.*{expected}"):
        run(target_dir, data, tmp_path / "run", "distill.max_steps=4", "distill.eval_every=0")


def test_a_feature_draft_exports_its_weight_average(target_dir, data, tmp_path):
    run(target_dir, data, tmp_path, "distill.max_steps=4", "distill.eval_every=4", "distill.save_every=4",
        "distill.ema_decay=0.5")
    checkpoint = tmp_path / "checkpoints/step-4"
    average = torch.load(checkpoint / "custom_checkpoint_1.pkl", weights_only=True)["average"]
    exported = [(name, p) for name, p in FeatureDraft.load(tmp_path / "final").named_parameters() if p.requires_grad]
    assert len(exported) == len(average) and all(torch.equal(a, p) for a, (_, p) in zip(average, exported))
    trained = load_file(checkpoint / "model.safetensors")  # the training weights, which the average is not
    assert any(not torch.equal(trained[f"draft.{name}"], p) for name, p in exported)


def test_a_run_goes_on_from_a_feature_draft(target_dir, data, tmp_path):
    steps = ["distill.eval_every=0", "distill.save_every=0", "distill.lr=0.01", "distill.warmup_steps=1"]
    run(target_dir, data, tmp_path / "first", "distill.max_steps=12", *steps)
    first = FeatureDraft.load(tmp_path / "first" / "final")
    # vocab_subset=0, as with a standalone init: the run keeps the init's head rows and weights.
    run(target_dir, data, tmp_path / "next", "distill.max_steps=1", f"distill.init={tmp_path / 'first' / 'final'}",
        "distill.vocab_subset=0", *steps)
    after = FeatureDraft.load(tmp_path / "next" / "final")
    assert torch.equal(after.draft_ids, first.draft_ids)
    first_losses = [r["train/loss"] for r in rows(tmp_path / "first") if "train/loss" in r]
    next_loss = [r["train/loss"] for r in rows(tmp_path / "next") if "train/loss" in r][0]
    # The same seed from scratch would repeat the first run's first loss; from its weights it starts where it ended.
    assert next_loss < 0.6 * first_losses[0] and next_loss < 1.2 * first_losses[-1]


def test_a_feature_init_that_cannot_fit_is_refused_before_training(target_dir, data, tmp_path):
    run(target_dir, data, tmp_path / "first", "distill.max_steps=1", "distill.eval_every=0", "distill.save_every=0")
    with pytest.raises(UserError, match="distill.init: feature draft folder .* does not exist"):
        run(target_dir, tmp_path / "no-data", tmp_path / "a", f"distill.init={tmp_path / 'missing'}",
            "distill.vocab_subset=0")
    with pytest.raises(UserError, match=r"set distill.feature_layers=\[0, 2\]"):
        run(target_dir, tmp_path / "no-data", tmp_path / "b", f"distill.init={tmp_path / 'first' / 'final'}",
            "distill.feature_layers=[0,1]", "distill.vocab_subset=0")
    save_target(tmp_path / "wide", hidden=32)
    with pytest.raises(UserError, match="does not fit the target: hidden size 64 vs the target's 32"):
        run(tmp_path / "wide", tmp_path / "no-data", tmp_path / "c", f"distill.init={tmp_path / 'first' / 'final'}",
            "distill.vocab_subset=0")


def test_held_out_measures_a_feature_draft_as_its_run_does(target_dir, data, tmp_path, capsys):
    """`python -m distill.held_out` on a feature draft's final/ gives its run's last evaluation (the same held-out
    rows, the draft unrolled the same way): α per proposal position, τ(4) and top-1 agreement, in one table
    with a standalone draft (here the target itself), whose tempered columns the feature row leaves empty."""
    run(target_dir, data, tmp_path / "run", "distill.max_steps=3", "distill.eval_every=0", "distill.save_every=0")
    last = [r for r in rows(tmp_path / "run") if "eval/alpha" in r][-1]
    standalone, final = tmp_path / "standalone", tmp_path / "run" / "final"
    load_model(str(target_dir)).save_pretrained(standalone)
    load_tokenizer(str(target_dir)).save_pretrained(standalone)
    overrides = [f"target={target_dir}", f"distill.data_dirs=[{data}]", "distill.eval_samples=8"]
    results = held_out_main(["--config", str(ROOT / "configs/tiny.yaml"), *overrides, "--drafts", str(standalone),
                             str(final)])
    feature = results[str(final)]
    assert feature["alpha_steps_T1"] == pytest.approx([last[f"eval/alpha_step{j}"] for j in range(4)], rel=1e-4)
    assert feature["tau_k4_T1"] == pytest.approx(last["eval/tau_k4"], rel=1e-4)
    assert feature["alpha_greedy"] == pytest.approx(last["eval/top1"], rel=1e-4)
    assert len(feature["alpha_steps_greedy"]) == 4 and "alpha_T0.7" not in feature
    assert results[str(standalone)]["alpha_T1"] == pytest.approx(1.0)
    assert f"| {final} | {feature['alpha_T1']:.4f} | {feature['tau_k4_T1']:.3f} | – | – |" in capsys.readouterr().out
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "feature_draft.json").write_text((final / "feature_draft.json").read_text())
    with pytest.raises(ConfigError, match="--drafts: feature draft folder .* has no model.safetensors"):
        held_out_main(["--config", str(ROOT / "configs/tiny.yaml"), *overrides, "--drafts", str(broken)])
