"""The distillation loop (RELIABILITY 13-17, 19, 21): equivalences, resume, crash/SIGTERM safety,
non-finite guard, DeepSpeed, LoRA, golden losses and a `make distill` smoke run. Tiny models, CPU."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common import precision
from common.config import ConfigError, load_config
from common.models import load_model, load_tokenizer
from decode.vocab import VocabSubset
from distill.checkpoint import latest_checkpoint
from distill.data import DataError, StepSampler, load_examples, mixture_quotas
from distill.disk import DiskFullError
from distill.export.__main__ import main as export_main
from distill.train import train
from distill.training.recipe import NonFiniteError
from distill.training.resume import changed_settings
from tests.synthetic_shards import write_manifest, write_scored_shards


ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# One thread per process: two busy cores and OpenMP spinning make training ~10x slower otherwise.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
# configs/tiny.yaml's first losses on the `data` fixture (recorded once the code was trusted).
GOLDEN_LOSSES = [0.0071490746922791, 0.00741421477869153, 0.005545787513256073]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """24 train + 8 eval rows of variable length, scored by tiny:target (top-8 cache)."""
    return write_scored_shards(tmp_path_factory.mktemp("data"), load_model("tiny:target"))


# The serving export at the end of a run (~2 s for a tiny draft, most of such a run) is left to the tests
# that check it: they pass distill.export=true.
NO_EXPORT = "distill.export=false"


def run(data, out, *overrides):
    """Train in-process on configs/tiny.yaml with overrides; returns the summary."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # each run builds its own Accelerator
    config = load_config(ROOT / "configs/tiny.yaml", [f"distill.data_dirs=[{data}]", f"distill.out_dir={out}",
                                                      "wandb.mode=disabled", NO_EXPORT, *overrides])
    return train(config)


def weights(path):
    return load_file(Path(path) / "model.safetensors")


def assert_same_weights(a, b, **tolerance):
    a, b = weights(a), weights(b)
    # A DeepSpeed-gathered state dict also names the tied head; the embedding is the same tensor.
    a.pop("lm_head.weight", None), b.pop("lm_head.weight", None)
    assert_same_tensors(a, b, **tolerance)


def assert_same_tensors(a: dict, b: dict, atol=1e-6, outliers=0.0, outlier_atol=0.0):
    """Every weight within atol, except at most a fraction `outliers` of each tensor's, within outlier_atol."""
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key] - b[key]).abs()
        far = diff > atol
        assert far.float().mean() <= outliers and diff[far].le(outlier_atol).all(), (key, diff.max(), far.sum())


def losses(out):
    lines = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {l["step"]: l["train/loss"] for l in lines if "train/loss" in l}


def torchrun(*args, timeout=240):
    cmd = [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "distill.train",
           "--config", "configs/tiny.yaml", NO_EXPORT, *args]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


# With the weight average on, the final/ weights compared are averages (distill/training/weight_average.py), which
# two ranks and DeepSpeed ZeRO-2 must reproduce as well.
STEPS = ["distill.max_steps=3", "distill.eval_every=0", "distill.save_every=0", "distill.ema_decay=0.5"]
# Splitting a step changes only float summation order. Losses agree to 1e-5; AdamW divides by
# √v, so where a gradient is ~0 that noise can move a weight by up to about lr (3e-3 here): weights
# are compared at 2e-4, far below the ~1e-2 that 3 steps move them, except a few per tensor, within lr.
# On a 2-core AVX2 EPYC 2 of the embedding's 41,040 weights moved 2.3-2.8e-4 (every other weight < 5e-5);
# accumulating the wrong gradient moves most weights by ~1e-2.
SPLIT = {"atol": 2e-4, "outliers": 1e-3, "outlier_atol": 3e-3}


@pytest.fixture(scope="session")
def reference(data, tmp_path_factory):
    """One batch of 8 per step, one process: what every split of the step must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    run(data, out, "distill.micro_batch_size=8", *STEPS)
    return out


def test_sharding_covers_every_example_once_per_epoch():
    for world in (1, 2, 3):
        sampler = StepSampler(25, micro_batch_size=2, grad_accum=3, world_size=world, seed=7)
        seen = [i for step in range(sampler.steps_per_epoch) for rank in range(world)
                for micro in sampler.micro_batches(step, rank) for i in micro]
        assert sorted(seen) == list(range(25))
        # the next epoch is a different order of the same examples
        nxt = [i for rank in range(world) for m in sampler.micro_batches(sampler.steps_per_epoch, rank) for i in m]
        assert len(set(nxt)) == len(nxt)
    one, two = StepSampler(25, 4, 2, 1, 7), StepSampler(25, 2, 2, 2, 7)
    for step in range(5):  # same examples per optimizer step whatever the split
        assert sorted(i for m in one.micro_batches(step, 0) for i in m) == \
            sorted(i for r in range(2) for m in two.micro_batches(step, r) for i in m)


def test_grouping_by_length_pads_less_and_keeps_every_example_once_per_epoch():
    """25 rows of lengths 1..25 shuffled, 4 a step, windows of 3 steps: every step but the epoch's short last one
    is full, each epoch holds every row once, a step's rows are close in length, and the same seed repeats it."""
    lengths = torch.randperm(25, generator=torch.Generator().manual_seed(1)).add(1).tolist()

    def padding(sampler):
        steps = [sampler.micro_batches(step, 0)[0] for step in range(sampler.steps_per_epoch)]
        return sum(max(lengths[i] for i in s) * len(s) - sum(lengths[i] for i in s) for s in steps), steps

    grouped = StepSampler(25, 4, 1, 1, seed=5, lengths=lengths, length_window=3)
    random_draw = StepSampler(25, 4, 1, 1, seed=5)
    (pad_grouped, steps), (pad_random, _) = padding(grouped), padding(random_draw)
    assert sorted(i for s in steps for i in s) == list(range(25))
    assert [len(s) for s in steps] == [4] * 6 + [1]
    assert pad_grouped < pad_random / 2
    assert grouped.epoch_order(1) != grouped.epoch_order(0)
    assert StepSampler(25, 2, 2, 1, seed=5, lengths=lengths, length_window=3).epoch_order(0) == grouped.epoch_order(0)
    assert StepSampler(25, 4, 1, 1, seed=5, lengths=lengths, length_window=0).epoch_order(0) == \
        random_draw.epoch_order(0)


def test_a_mixture_draws_each_folders_share_of_every_epoch():
    """20 rows of folder 0 and 5 of folder 1 weighed 0.5 / 0.5: each epoch of 25 holds 12-13 of each, the small
    folder repeated, the large one sampled; the same steps give the same examples (resume needs nothing else)."""
    groups = [0] * 20 + [1] * 5
    sampler = StepSampler(25, 4, 1, 1, seed=3, groups=groups, weights=[0.5, 0.5])
    for epoch in range(3):
        order = sampler.epoch_order(epoch)
        drawn = Counter(groups[i] for i in order)
        assert len(order) == 25 and sorted(drawn.values()) == [12, 13]
        assert len(set(i for i in order if groups[i] == 0)) == drawn[0]  # the large folder: no row twice
        assert set(i for i in order if groups[i] == 1) == set(range(20, 25))  # the small one: every row
    again = StepSampler(25, 2, 2, 1, seed=3, groups=groups, weights=[0.5, 0.5])
    assert sorted(i for m in sampler.micro_batches(9, 0) for i in m) == sorted(i for m in again.micro_batches(9, 0) for i in m)
    assert mixture_quotas(7, [1.0, 0.0, 0.3], [5, 5, 5]) == [5, 0, 2]
    with pytest.raises(DataError, match=r"data dirs \[1\] \(0-based\) a weight but they hold no training rows"):
        StepSampler(5, 1, 1, 1, 0, groups=[0] * 5, weights=[0.5, 0.5])


def test_a_run_from_before_a_setting_existed_resumes_under_its_old_behaviour():
    """A config.yaml without distill.data_weights was trained with every row once per epoch, i.e. []."""
    assert changed_settings({"distill": {"lr": 0.1}}, {"distill": {"lr": 0.1, "data_weights": []}}) == []
    assert changed_settings({"distill": {"lr": 0.1}}, {"distill": {"lr": 0.1, "data_weights": [1.0]}}) == [
        "distill.data_weights: [] -> [1.0]"]


def test_grad_accumulation_equals_one_big_batch(data, reference, tmp_path):
    run(data, tmp_path, "distill.micro_batch_size=2", "distill.grad_accum=4", *STEPS)
    assert_same_weights(tmp_path / "final", reference / "final", **SPLIT)
    ref = losses(reference)
    assert all(abs(l - ref[s]) < 1e-5 for s, l in losses(tmp_path).items())


def test_two_ranks_equal_one_process(data, reference, tmp_path):
    torchrun(f"distill.data_dirs=[{data}]", f"distill.out_dir={tmp_path}", "wandb.mode=disabled",
             "distill.micro_batch_size=2", "distill.grad_accum=2", *STEPS)
    assert_same_weights(tmp_path / "final", reference / "final", **SPLIT)
    ref = losses(reference)
    assert all(abs(l - ref[s]) < 1e-5 for s, l in losses(tmp_path).items())


def test_deepspeed_zero2_on_two_cpu_processes(data, reference, tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install '.[deepspeed]')")
    torchrun(f"distill.data_dirs=[{data}]", f"distill.out_dir={tmp_path}", "wandb.mode=disabled",
             "distill.micro_batch_size=2", "distill.grad_accum=2", "distill.deepspeed_config=configs/deepspeed_zero2.json",
             *STEPS)
    ref = losses(reference)
    assert all(abs(l - ref[s]) < 1e-4 for s, l in losses(tmp_path).items())
    assert_same_weights(tmp_path / "final", reference / "final", **SPLIT)
    assert (tmp_path / "checkpoints/step-3/COMPLETE").exists()


def test_resume_mid_epoch_matches_a_straight_run(data, tmp_path):
    common = ["distill.max_steps=8", "distill.eval_every=4", "distill.save_every=0"]  # 6 steps/epoch
    run(data, tmp_path / "straight", *common)
    summary = run(data, tmp_path / "resumed", *common, "distill.stop_after=3")
    assert summary["stopped"] == "interrupted" and not (tmp_path / "resumed/final").exists()
    run(data, tmp_path / "resumed", *common)
    a, b = tmp_path / "straight/checkpoints/step-8", tmp_path / "resumed/checkpoints/step-8"
    assert_same_weights(a, b, atol=0)
    opt_a, opt_b = torch.load(a / "optimizer.bin"), torch.load(b / "optimizer.bin")
    for i in opt_a["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_a["state"][i][key], opt_b["state"][i][key])
    sched_a = torch.load(a / "custom_checkpoint_0.pkl", weights_only=False)
    assert sched_a == torch.load(b / "custom_checkpoint_0.pkl", weights_only=False)
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")  # same data order
    assert json.loads((a / "train_state.json").read_text())["best_step"] == \
        json.loads((b / "train_state.json").read_text())["best_step"]


def test_crash_during_save_keeps_the_previous_checkpoint(data, tmp_path, monkeypatch):
    from accelerate import Accelerator

    real_save = Accelerator.save_state

    def failing_save(self, output_dir, **kwargs):
        if "step-4" in str(output_dir):
            (Path(output_dir) / "model.safetensors").write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        return real_save(self, output_dir, **kwargs)

    common = ["distill.max_steps=6", "distill.save_every=2", "distill.eval_every=0"]
    monkeypatch.setattr(Accelerator, "save_state", failing_save)
    with pytest.raises(DiskFullError, match="no space left on device while saving .*step-4"):
        run(data, tmp_path, *common)
    assert (tmp_path / "checkpoints/.tmp-step-4").exists()
    assert latest_checkpoint(tmp_path).name == "step-2"
    (tmp_path / "checkpoints/step-5").mkdir()  # a folder without its COMPLETE marker is ignored too
    assert latest_checkpoint(tmp_path).name == "step-2"
    monkeypatch.setattr(Accelerator, "save_state", real_save)
    summary = run(data, tmp_path, *common)
    assert summary["step"] == 6 and latest_checkpoint(tmp_path).name == "step-6"
    assert not (tmp_path / "checkpoints/.tmp-step-4").exists()
    # Steps 3 and 4 ran twice (logged, then lost with the failed save): each has one row.
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5, 6]


def test_resume_with_a_changed_learning_rate_is_refused(data, tmp_path):
    common = ["distill.eval_every=0", "distill.save_every=0"]
    run(data, tmp_path, *common, "distill.max_steps=3", "distill.stop_after=1")
    with pytest.raises(ConfigError, match=r"distill\.lr: 0\.003 -> 0\.001") as refused:
        run(data, tmp_path, *common, "distill.max_steps=4", "distill.lr=0.001")
    assert "max_steps" not in str(refused.value)  # settings that bound the run may change
    assert latest_checkpoint(tmp_path).name == "step-1"
    assert run(data, tmp_path, *common, "distill.max_steps=4")["step"] == 4


def test_sigterm_saves_at_a_step_boundary_and_exits_cleanly(data, tmp_path):
    cmd = [PY, "-m", "distill.train", "--config", "configs/tiny.yaml", f"distill.data_dirs=[{data}]",
           f"distill.out_dir={tmp_path}", "wandb.mode=disabled", "distill.max_steps=100000", "distill.eval_every=0",
           "distill.save_every=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output[-3000:]
    assert "interrupted; checkpoint saved" in output
    ckpt = latest_checkpoint(tmp_path)
    state = json.loads((ckpt / "train_state.json").read_text())
    assert ckpt.name == f"step-{state['step']}" and state["step"] >= 2
    assert max(losses(tmp_path)) == state["step"]  # every logged step is in the checkpoint


def test_non_finite_teacher_never_reaches_the_optimizer(tmp_path):
    target = load_model("tiny:target")
    clean = write_scored_shards(tmp_path / "clean", target, n_train=4, n_eval=2)
    data = write_scored_shards(tmp_path / "data", target, n_train=4, n_eval=2)
    for shard in sorted(data.glob("*.parquet")):  # poison train row 2 with +inf teacher logprobs
        rows = pq.read_table(shard).to_pylist()
        rows[2]["teacher_topk_logprobs"][0][0] = float("inf")
        pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(shard)), shard)
        break
    write_manifest(data)
    with pytest.raises(NonFiniteError, match=r"step 1 \(epoch 0\).*micro-batch 0.*train examples"):
        run(data, tmp_path / "strict", "distill.micro_batch_size=4", "distill.max_bad_steps=0")
    # Tolerating bad steps: every step holds the poisoned row, so nothing is ever stepped.
    summary = run(data, tmp_path / "lenient", "distill.micro_batch_size=4", "distill.max_bad_steps=3",
                  "distill.max_steps=3", "distill.eval_every=0", "distill.save_every=0")
    assert summary["bad_steps"] == 3
    optimizer = torch.load(tmp_path / "lenient/checkpoints/step-3/optimizer.bin")
    assert optimizer["state"] == {}  # AdamW never stepped
    # Same rows without the inf (same vocabulary subset, same seeded init), learning rate 0.
    run(clean, tmp_path / "untrained", "distill.micro_batch_size=4", "distill.lr=0.0", "distill.max_steps=1",
        "distill.eval_every=0", "distill.save_every=0")
    assert_same_weights(tmp_path / "lenient/final", tmp_path / "untrained/final", atol=0)


def test_corrupt_shard_is_named(tmp_path):
    data = write_scored_shards(tmp_path / "data", load_model("tiny:target"), n_train=20, n_eval=4)
    shard = sorted(data.glob("*.parquet"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(Exception, match=shard.name):
        load_examples([str(data)], 64, need_topk=True)


def test_training_reads_exactly_the_shards_the_manifest_lists(tmp_path):
    data = write_scored_shards(tmp_path / "data", load_model("tiny:target"), n_train=20, n_eval=4)
    train_set, eval_set = load_examples([str(data)], 64, need_topk=True)
    first = sorted(data.glob("*.parquet"))[0]
    (data / "shard-00000 (copy).parquet").write_bytes(first.read_bytes())  # a stray copy
    with pytest.warns(UserWarning, match=r"shard-00000 \(copy\)\.parquet.*does not list"):
        again = load_examples([str(data)], 64, need_topk=True)
    assert (len(again[0]), len(again[1])) == (len(train_set), len(eval_set))


def test_a_shard_that_differs_from_the_manifest_is_refused(tmp_path):
    data = write_scored_shards(tmp_path / "data", load_model("tiny:target"), n_train=20, n_eval=4)
    shard = sorted(data.glob("*.parquet"))[1]
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows - 1), shard)  # readable, one row short
    with pytest.raises(DataError, match=f"{shard.name}.*sha256"):
        load_examples([str(data)], 64, need_topk=True)
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard.name}.*missing"):
        load_examples([str(data)], 64, need_topk=True)


def test_export_of_a_finished_run_is_the_draft_it_trained(reference, tmp_path):
    out = tmp_path / "hf"
    export_main(["--run", str(reference), "--out", str(out)])  # `python -m distill.export`, in this process
    assert_same_weights(out, reference / "final", atol=0)
    exported, trained = (VocabSubset.from_config(AutoModelForCausalLM.from_pretrained(p).config)
                         for p in (out, reference / "final"))
    assert torch.equal(exported.ids, trained.ids) and exported.size == 512
    assert exported.full_vocab_size == trained.full_vocab_size == 49152
    for name in ("config.yaml", "metrics.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (reference / "final" / name).read_bytes()


def test_identical_draft_has_zero_kl_and_full_acceptance(tmp_path, data):
    target_dir = tmp_path / "target"
    load_model("tiny:target").save_pretrained(target_dir)
    load_tokenizer("tiny:target").save_pretrained(target_dir)
    for teacher in ("online", "cached"):
        out = tmp_path / teacher
        summary = run(data, out, f"target={target_dir}", f"distill.init={target_dir}", "distill.vocab_subset=0",
                      f"distill.teacher={teacher}", "distill.lr=0.0", "distill.max_steps=1")
        assert abs(summary["final/kl"]) < 1e-4, summary
        assert summary["final/top1"] == 1.0
        if teacher == "online":
            assert summary["final/alpha"] > 0.9999
        else:  # a lower bound: the stored top-K mass of a near-uniform tiny target is small
            assert 0 < summary["final/alpha"] < 1
        assert abs(losses(out)[1]) < 1e-4


def test_lora_from_pretrained_merges_on_export(tmp_path, data):
    ref = tmp_path / "pretrained"
    load_model("tiny:draft").save_pretrained(ref)
    load_tokenizer("tiny:draft").save_pretrained(ref)
    run(data, tmp_path / "run", f"distill.init={ref}", "distill.lora_rank=4", "distill.vocab_subset=0",
        "distill.teacher=online", "distill.lr=0.05", "distill.max_steps=3")
    final = tmp_path / "run/final"
    merged = weights(final)
    assert not any("lora" in k for k in merged)
    base = weights(ref)
    changed = [k for k in base if "proj" in k and not torch.equal(base[k], merged[k])]
    assert changed  # the adapters were merged into the base projections
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.vocab_size == 49152


def test_golden_losses_on_tiny_config(data, tmp_path):
    # Recorded before distill.spread_other became the default: without it the tiny target's flat
    # distributions leave losses of ~1e-2 (with it, ~1e-6: too small for a golden value to catch much).
    run(data, tmp_path, "distill.eval_every=0", "distill.save_every=0", "distill.max_steps=3",
        "distill.spread_other=false")
    got = [losses(tmp_path)[s] for s in (1, 2, 3)]
    if GOLDEN_LOSSES is None:
        pytest.fail(f"record GOLDEN_LOSSES = {got}")
    assert got == pytest.approx(GOLDEN_LOSSES, abs=1e-4)


def test_missing_teacher_cache_is_a_clear_error(tmp_path):
    shard_dir = tmp_path / "nocache"
    shard_dir.mkdir()
    pq.write_table(pa.Table.from_pylist([dict(prompt_ids=[1, 2], completion_ids=[3], split="train", source="x")]),
                   shard_dir / "a.parquet")
    write_manifest(shard_dir)
    with pytest.raises(DataError, match="teacher_topk"):
        load_examples([str(shard_dir)], 64, need_topk=True)


def test_source_filter_keeps_one_workload(tmp_path):
    shard_dir = tmp_path / "mixed"
    shard_dir.mkdir()
    rows = [dict(prompt_ids=[1, 2], completion_ids=[3, 4], split=split, source=source)
            for source in ("gsm8k", "freshqa") for split in ("train", "train", "eval")]
    pq.write_table(pa.Table.from_pylist(rows), shard_dir / "a.parquet")
    write_manifest(shard_dir)
    train_set, eval_set = load_examples([str(shard_dir)], 64, need_topk=False, sources=["gsm8k"])
    assert [e.source for e in train_set] == ["gsm8k", "gsm8k"] and [e.source for e in eval_set] == ["gsm8k"]
    assert len(load_examples([str(shard_dir)], 64, need_topk=False)[0]) == 4
    with pytest.raises(DataError, match=r"\['humaneval'\] not in .*\['freshqa', 'gsm8k'\]"):
        load_examples([str(shard_dir)], 64, need_topk=False, sources=["humaneval"])


@pytest.mark.parametrize("spread", [False, True])
def test_spread_other_travels_with_the_trained_draft(data, tmp_path, spread, capsys):
    # distill.spread_other trains the "other" row as mass spread over the outside tokens: the flag must reach
    # final/, where the decoder and `distill.export --format hf-full` read it (off: the draft is as before).
    # The run then exports for serving engines only the draft that exports exactly.
    run(data, tmp_path, "distill.max_steps=2", "distill.eval_every=0", "distill.save_every=0",
        f"distill.spread_other={str(spread).lower()}", "distill.export=true")
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert VocabSubset.from_config(draft.config).spread_other is spread
    printed = capsys.readouterr().out
    if not spread:
        assert "export skipped" in printed and "distill.spread_other=true" in printed
        assert not (tmp_path / "export").exists()
        return
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "hf")
    assert full.config.vocab_size == 49152 and VocabSubset.from_config(full.config) is None
    assert sorted(f.name for f in (tmp_path / "export" / "gguf").glob("*.gguf")) == ["draft-f16.gguf",
                                                                                     "draft-q8_0.gguf"]
    record = json.loads((tmp_path / "export" / "hf" / "export.json").read_text())
    assert record["source"] == str((tmp_path / "final").resolve()) and record["format"] == "hf-full"


def test_no_serving_export_when_turned_off_or_interrupted(data, tmp_path):
    steps = ["distill.max_steps=2", "distill.eval_every=0", "distill.save_every=0", "distill.spread_other=true"]
    run(data, tmp_path / "off", *steps, "distill.export=false")
    assert (tmp_path / "off" / "final").is_dir() and not (tmp_path / "off" / "export").exists()
    run(data, tmp_path / "cut", *steps, "distill.stop_after=1", "distill.export=true")
    assert not (tmp_path / "cut" / "final").exists() and not (tmp_path / "cut" / "export").exists()


def test_precision_auto_is_resolved_once_and_resumes_as_resolved(data, tmp_path, monkeypatch, capsys):
    """distill.precision=auto resolves per machine, into the config.yaml the run writes; a run whose
    config.yaml still says 'auto' resumes where auto resolves as before, and not where it differs."""
    monkeypatch.setattr(precision, "native_bf16", lambda device: (False, "no native bf16 (test)"))
    chunk = ["distill.precision=auto", "distill.eval_every=0", "distill.save_every=1", "distill.stop_after=1"]
    run(data, tmp_path, "distill.max_steps=2", *chunk)
    assert "distill.precision: auto -> fp32 (no native bf16 (test))" in capsys.readouterr().out
    written = tmp_path / "config.yaml"
    assert "precision: fp32" in written.read_text()
    written.write_text(written.read_text().replace("precision: fp32", "precision: auto"))
    assert run(data, tmp_path, "distill.max_steps=2", *chunk)["step"] == 2
    monkeypatch.setattr(precision, "native_bf16", lambda device: (True, "native bf16 (test)"))
    with pytest.raises(ConfigError, match="distill.precision: 'fp32' -> 'bf16'"):
        run(data, tmp_path, "distill.max_steps=3", *chunk)
