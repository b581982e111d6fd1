"""generate-data on tiny models: sampling semantics, the teacher cache, shards, resume, ranks (RELIABILITY 19-22)."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from common import precision
from common.config import load_config
from common.errors import UserError
from common.models import load_model, load_tokenizer
from common.progress import BatchProgress
from common.prompts import chat_token_ids, load_prompt_set
from common.sampling import NUCLEUS_CANDIDATES, ROW_CANDIDATES, SamplingParams, sample, sample_rows, warp_probs
from decode.runners.batched import LeanBatchedRunner
from decode.runners.hf import HFBatchedRunner
from distill.generation.batched_loop import generate_batch, score_batch
from distill.generation.engine import Completion
from distill.generation.pairs import clean_gsm8k
from distill.generation.plan import PLAN_FILE, ResumeMismatch
from distill.generation.run import run
from distill.generation.runner_engine import row_uniforms
from distill.generation.shards import CorruptShardError, verify_shards


ROOT = Path(__file__).resolve().parents[1]
# 24 prompts in 3 shards of 8 rows, 8 new tokens: a whole run takes a few seconds.
SMALL = ["generate.max_prompts=24", "generate.shard_size=8", "generate.max_new_tokens=8",
         "generate.batch_size=8", "generate.teacher_topk=4", "wandb.mode=disabled"]


def config_for(out_dir, *overrides):
    return load_config(ROOT / "configs/tiny.yaml", [f"generate.out_dir={out_dir}", *SMALL, *overrides])


def read_rows(out_dir) -> list[dict]:
    return [row for path in sorted(Path(out_dir).glob("shard-*.parquet")) for row in pq.read_table(path).to_pylist()]


@pytest.fixture(scope="module")
def target():
    return load_model("tiny:target")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("full")
    run(config_for(out_dir))
    return out_dir


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (5, 1.0), (5, 0.6), (0, 1.0)])
def test_sample_rows_samples_warp_probs_distribution(top_k, top_p):
    # Sweep the uniforms finely over [0, 1): the fraction of them mapped to each id is the distribution drawn from.
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 2
    uniforms = torch.arange(20000, dtype=torch.float64) / 20000
    ids = sample_rows(logits.expand(len(uniforms), -1), uniforms, SamplingParams(0.7, top_k, top_p))
    drawn = torch.bincount(ids, minlength=50).double() / len(uniforms)
    torch.testing.assert_close(drawn, warp_probs(logits, 0.7, top_k, top_p)[0].double(), atol=2e-4, rtol=0)


@pytest.mark.parametrize("scale", [3.0, 0.01])  # a peaked row (nucleus within the candidates), a flat one (beyond)
@pytest.mark.parametrize("top_k", [0, 700])
def test_warp_probs_keeps_the_nucleus_of_a_full_sort(scale, top_k):
    """warp_probs finds the nucleus among the most likely NUCLEUS_CANDIDATES tokens, sorting a row only
    when they hold less than top_p: the same tokens as sorting every row."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)) * scale
    probs = warp_probs(logits, 0.7, top_k, 0.9)
    scaled = logits / 0.7
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    sorted_probs, order = scaled.softmax(-1).sort(dim=-1, descending=True)
    inside = sorted_probs.cumsum(-1) - sorted_probs < 0.9  # the mass before a token is below top_p
    kept = inside.scatter(-1, order, inside)
    assert torch.equal(probs > 0, kept)
    assert (kept.sum(-1) > 512).all() == (scale < 1)  # both paths were taken
    torch.testing.assert_close(probs, scaled.masked_fill(~kept, float("-inf")).softmax(-1))


def test_sample_rows_draws_each_row_from_warp_probs_whatever_its_nucleus_size():
    """Rows whose nucleus lies within ROW_CANDIDATES, within NUCLEUS_CANDIDATES, and beyond both, in one batch."""
    slopes = torch.tensor([0.2, 0.01, 0.0005])[:, None]  # nucleus of ~8, ~160 and ~900 tokens at T = 0.7, top-p 0.9
    logits = -slopes * torch.arange(1000.0)
    sampling = SamplingParams(0.7, 0, 0.9)
    expected = warp_probs(logits, 0.7, 0, 0.9).double()
    sizes = (expected > 0).sum(-1)
    assert sizes[0] <= ROW_CANDIDATES < sizes[1] <= NUCLEUS_CANDIDATES < sizes[2]
    n = 4000
    uniforms = (torch.arange(n, dtype=torch.float64) / n).repeat(3)
    ids = sample_rows(logits.repeat_interleave(n, 0), uniforms, sampling).view(3, n)
    drawn = torch.stack([torch.bincount(row, minlength=1000) for row in ids]).double() / n
    torch.testing.assert_close(drawn, expected, atol=1.01 / n, rtol=0)


def test_sample_rows_falls_back_when_the_nucleus_exceeds_the_candidates():
    logits = torch.zeros(1, 2000)  # flat: the 0.95 nucleus holds 1900 tokens, more than 512 candidates
    uniforms = torch.arange(4000, dtype=torch.float64) / 4000
    ids = sample_rows(logits.expand(len(uniforms), -1), uniforms, SamplingParams(1.0, 0, 0.95))
    assert ids.unique().numel() > 1800 and ids.max() < 2000
    assert sample_rows(torch.tensor([[0.0, 3.0, 1.0]]), torch.tensor([0.5]), SamplingParams()).item() == 1  # greedy


def test_batched_and_batch_1_samplers_share_one_convention():
    # The same uniforms (one generator seed) pick the same tokens through both entries, at the edges
    # too: u = 0 takes the first token with mass, u just below 1 the last one (never a zero-mass token).
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3
    logits[:, :3] = logits[:, -3:] = float("-inf")
    batch_1 = sample(logits.softmax(-1), torch.Generator().manual_seed(2))
    uniforms = torch.rand(64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.equal(sample_rows(logits, uniforms, SamplingParams(1.0)), batch_1)
    edges = sample_rows(logits[:2], torch.tensor([0.0, 1 - 2 ** -53], dtype=torch.float64), SamplingParams(1.0))
    assert edges.tolist() == [3, 296]


def test_lean_runner_matches_hf_forward(target, monkeypatch):
    monkeypatch.setattr("decode.runners.batched.PREFILL_CHUNK_POSITIONS", 6)  # 3 prefill chunks of their own lengths
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    lean, hf = LeanBatchedRunner(target), HFBatchedRunner(target)
    with torch.no_grad():
        alone = torch.stack([target(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(lean.prefill(prompts, 8), alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(hf.prefill(prompts, 8), alone, atol=1e-5, rtol=0)
    lean.keep(torch.tensor([2, 0]))
    hf.keep(torch.tensor([2, 0]))
    with torch.no_grad():
        alone = torch.stack([target(torch.tensor([p + [20]])).logits[0, -1] for p in (prompts[2], prompts[0])])
    torch.testing.assert_close(lean.step(torch.tensor([20, 20])), alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(hf.step(torch.tensor([20, 20])), alone, atol=1e-5, rtol=0)
    bf16 = LeanBatchedRunner(target, torch.bfloat16)  # bf16 GEMMs, fp32 everywhere else
    torch.testing.assert_close(bf16.prefill([prompts[0]], 8)[0], lean.prefill([prompts[0]], 8)[0], atol=2e-2, rtol=0)


def test_keep_copies_a_row_listed_twice(target):
    """Both batched runners: keep([1, 0, 1]) gives prompt 1's cache to two rows, which then decode apart."""
    prompts, steps = [[5, 6, 7], [8, 9]], [([8, 9], 20), ([5, 6, 7], 20), ([8, 9], 21)]
    with torch.no_grad():
        alone = torch.stack([target(torch.tensor([p + [t]])).logits[0, -1] for p, t in steps])
    for runner in (LeanBatchedRunner(target), HFBatchedRunner(target)):
        runner.prefill(prompts, 6)
        runner.keep(torch.tensor([1, 0, 1]))
        torch.testing.assert_close(runner.step(torch.tensor([t for _, t in steps])), alone, atol=1e-5, rtol=0)


def test_batched_cache_reads_no_slot_before_writing_or_zeroing_it(target, monkeypatch):
    """The cache is allocated empty (here: full of NaN): a decode step reads slots min(pad).. of every row,
    so the slots before a chunk of shorter prompts' start are zeroed, the rest written before they are read."""
    monkeypatch.setattr("decode.runners.batched.PREFILL_CHUNK_POSITIONS", 6)  # 3 chunks, starting at slots 0, 3, 2
    prompts, tokens = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], torch.tensor([20, 21, 22])

    def forward():
        runner = LeanBatchedRunner(target)
        first = runner.prefill(prompts, 9)
        runner.keep(torch.tensor([1, 2, 0, 1]))
        return first, runner.step(tokens[[1, 2, 0, 1]]), runner.step(tokens[[0, 0, 0, 0]])

    expected = forward()
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
                        if kw.get("dtype", torch.float32).is_floating_point else empty(*a, **kw))
    for got, want in zip(forward(), expected):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _generate(target, prompts, batch_size, teacher_topk=0, top_p=0.95):
    uniforms = torch.stack([row_uniforms(0, f"p{i}", 0, 12) for i in range(len(prompts))])
    out = []
    for start in range(0, len(prompts), batch_size):
        out += generate_batch(LeanBatchedRunner(target), prompts[start:start + batch_size],
                              uniforms[start:start + batch_size], max_new_tokens=12,
                              sampling=SamplingParams(0.7, 0, top_p), eos_ids=[2], teacher_topk=teacher_topk)
    return out


# The tiny random target's next-token distribution is nearly flat over 49k tokens, so rounding
# noise between batch shapes moves which tokens sit at the edge of a top-p nucleus; batch
# independence is checked with top-p off, where only the fp64 CDF's ~1e-9 steps could move a draw.
NO_TOP_P = ["generate.top_p=1.0"]


def test_completion_does_not_depend_on_batch(target):
    prompts = [[1, 5 + i, 9, 30 + 2 * i] + [7] * (i % 3) for i in range(6)]
    alone = _generate(target, prompts, 1, top_p=1.0)
    together = _generate(target, prompts, 6, top_p=1.0)
    assert [c.completion_ids.tolist() for c in alone] == [c.completion_ids.tolist() for c in together]
    assert all(len(c.completion_ids) == 12 or c.finish_reason == "eos" for c in together)


def test_samples_of_one_prompt_share_its_prefill(target, monkeypatch):
    """generate.samples_per_prompt puts a prompt's samples side by side: it is prefilled once and its cache
    rows copied, and each sample is still the completion its own row draws alone."""
    prompts = [[1, 5, 9, 30], [1, 5, 9, 30], [1, 8, 9, 31, 40], [1, 5, 9, 30]]
    prefilled = []
    prefill = LeanBatchedRunner.prefill
    monkeypatch.setattr(LeanBatchedRunner, "prefill",
                        lambda self, rows, **kw: prefilled.append(rows) or prefill(self, rows, **kw))
    together = _generate(target, prompts, 4, top_p=1.0)
    assert prefilled == [[[1, 5, 9, 30], [1, 8, 9, 31, 40]]]
    alone = _generate(target, prompts, 1, top_p=1.0)
    assert [c.completion_ids.tolist() for c in alone] == [c.completion_ids.tolist() for c in together]
    assert len({tuple(c.completion_ids.tolist()) for c in together[:2]}) == 2  # the samples differ


def test_teacher_topk_matches_a_fresh_forward(target):
    prompts = [[1, 5, 9, 30], [1, 8, 9, 31, 40, 41]]
    for prompt, c in zip(prompts, _generate(target, prompts, 2, teacher_topk=5)):
        sequence = torch.tensor([prompt + c.completion_ids.tolist()])
        with torch.no_grad():
            logprobs = target(sequence).logits[0].log_softmax(-1)[len(prompt) - 1:-1]  # [n, V]
        values, ids = logprobs.topk(5, dim=-1)
        assert (torch.from_numpy(c.topk_ids) == ids).all()
        torch.testing.assert_close(torch.from_numpy(c.topk_logprobs), values, atol=1e-5, rtol=0)
    # Score mode stores the same numbers for given text.
    prompt, completion = [1, 5, 9], [30, 31, 32, 2]
    (ids_s, logprobs_s), = score_batch(LeanBatchedRunner(target), [prompt], [completion], 5)
    with torch.no_grad():
        logprobs = target(torch.tensor([prompt + completion])).logits[0].log_softmax(-1)[2:-1]
    torch.testing.assert_close(torch.from_numpy(logprobs_s), logprobs.topk(5, -1).values, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- runs and shards


def test_run_writes_shards_and_manifest(finished_run):
    manifest = json.loads((finished_run / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) == 3 and manifest["rows"] == 24
    assert manifest["fingerprint"]["target"] == "tiny:target" and manifest["fingerprint"]["target_hash"]
    assert manifest["prompts"]["split_counts"]["train"] > 0
    rows = read_rows(finished_run)
    assert sorted(r["prompt_id"] for r in rows) == sorted({r["prompt_id"] for r in rows})
    for r in rows:
        assert r["mode"] == "generate" and r["finish_reason"] in ("eos", "length")
        assert len(r["teacher_topk_ids"]) == len(r["completion_ids"]) > 0
        assert len(r["teacher_topk_logprobs"][0]) == 4
    assert len(verify_shards(finished_run)) == 3


def test_result_does_not_depend_on_batch_size(tmp_path):
    run(config_for(tmp_path / "a", "generate.batch_size=3", *NO_TOP_P))
    run(config_for(tmp_path / "b", "generate.batch_size=8", *NO_TOP_P))
    key = lambda r: r["prompt_id"]  # noqa: E731
    small, big = sorted(read_rows(tmp_path / "a"), key=key), sorted(read_rows(tmp_path / "b"), key=key)
    assert [r["completion_ids"] for r in small] == [r["completion_ids"] for r in big]


def test_kill_and_resume_gives_every_prompt_once(finished_run, tmp_path):
    first = run(config_for(tmp_path, "generate.stop_after_shards=1"))
    assert not first["complete"] and len(first["shards"]) == 1
    with pytest.raises(CorruptShardError, match="incomplete"):
        verify_shards(tmp_path)
    # A kill -9 during a write leaves only a hidden temp file; the rerun removes it.
    (tmp_path / ".shard-00001.parquet.tmp-999").write_bytes(b"PAR1 half a shard")
    second = run(config_for(tmp_path))
    assert second["complete"] and not list(tmp_path.glob(".shard-*"))
    rows = read_rows(tmp_path)
    assert Counter(Counter(r["prompt_id"] for r in rows).values()) == {1: 24}
    key = lambda r: r["prompt_id"]  # noqa: E731
    assert sorted(rows, key=key) == sorted(read_rows(finished_run), key=key)


def test_resume_with_changed_settings_is_refused(finished_run, tmp_path):
    with pytest.raises(ResumeMismatch, match=r"temperature: 0.7 -> 0.9"):
        run(config_for(finished_run, "generate.temperature=0.9"))
    with pytest.raises(ResumeMismatch, match="target_hash"):
        run(config_for(finished_run, "target=tiny:draft"))
    # A folder written by the earlier sampler convention (its plan has no "sampler") draws other
    # tokens for the same seed: never resumed.
    (tmp_path / PLAN_FILE).write_text(json.dumps({
        k: v for k, v in json.loads((finished_run / PLAN_FILE).read_text()).items() if k != "sampler"}))
    with pytest.raises(ResumeMismatch, match="sampler: None -> "):
        run(config_for(tmp_path))
    assert not list(tmp_path.glob("shard-*"))


def test_resume_compares_the_resolved_dtype(finished_run, monkeypatch):
    """finished_run computed in fp32: generate.dtype=auto resumes it where auto resolves to fp32 (no
    native bf16) and is refused where it resolves to bf16."""
    monkeypatch.setattr(precision, "native_bf16", lambda device: (False, "no native bf16 (test)"))
    assert run(config_for(finished_run, "generate.dtype=auto"))["complete"]
    monkeypatch.setattr(precision, "native_bf16", lambda device: (True, "native bf16 (test)"))
    with pytest.raises(ResumeMismatch, match="dtype: 'fp32' -> 'bf16'"):
        run(config_for(finished_run, "generate.dtype=auto"))


class FixedEngine:
    """A stand-in engine: every row gets the completion [7, 2] (EOS) and a fixed teacher top-k, in
    batches of 5 rows."""

    sampler = "fixed"

    def generate(self, rows, sampling, max_new_tokens, teacher_topk, seed):
        for start in range(0, len(rows), 5):
            yield [Completion(np.array([7, 2], np.int32), "eos", np.zeros((2, teacher_topk), np.int32),
                              np.full((2, teacher_topk), -1.5, np.float32)) for _ in rows[start:start + 5]]

    def score(self, rows, teacher_topk):
        raise AssertionError("generate mode never scores")


def test_run_needs_only_the_engine_interface(tmp_path, monkeypatch):
    monkeypatch.setattr("distill.generation.run.RunnerEngine", lambda *args: FixedEngine())
    moves = []
    real_batch_done = BatchProgress.batch_done
    monkeypatch.setattr(BatchProgress, "batch_done", lambda self, rows, tokens: (moves.append((rows, tokens)),
                                                                                 real_batch_done(self, rows, tokens)))
    manifest = run(config_for(tmp_path))
    assert moves == [(5, 10)] * 4 + [(4, 8)]  # the progress moves once per finished batch, by its tokens
    assert manifest["complete"] and manifest["rows"] == 24 and manifest["fingerprint"]["sampler"] == "fixed"
    rows = read_rows(tmp_path)
    assert all(r["completion_ids"] == [7, 2] and r["finish_reason"] == "eos" for r in rows)
    assert all(r["teacher_topk_logprobs"] == [[-1.5] * 4] * 2 for r in rows)


@pytest.mark.parametrize("records, error", [
    ([], "no rows to generate"),  # an empty file
    ([{"prompt": ""}, {"prompt": "  "}], r"no rows to generate.*'empty': 2"),  # every prompt skipped
    ([{"text": "Hi there."}, {"text": "Why?"}], "text_field"),  # no record has the text_field ('prompt')
])
def test_no_prompts_stops_before_generating(tmp_path, records, error):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(UserError, match=error):
        run(config_for(tmp_path / "out", f"generate.sources=[{source}]"))
    assert not (tmp_path / "out" / "manifest.json").exists() and not (tmp_path / "out" / PLAN_FILE).exists()


def test_corrupt_shard_is_named(finished_run, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    shard = copy / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:200])  # truncated
    with pytest.raises(CorruptShardError, match="shard-00001.parquet"):
        verify_shards(copy)
    with pytest.raises(CorruptShardError, match="shard-00001.parquet"):
        run(config_for(copy))


def test_bad_prompts_reported_and_skipped(tmp_path):
    source = tmp_path / "prompts.jsonl"
    texts = ["Hi there.", "", "Hi there.", "long " * 300, "Tell me a joke.", "What is 3 * 4?"]
    source.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    manifest = run(config_for(tmp_path / "out", f"generate.sources=[{source}]", "generate.max_prompt_tokens=100"))
    assert manifest["complete"] and manifest["rows"] == 3
    assert manifest["prompts"]["skipped_by_reason"] == {"empty": 1, "duplicate": 1, "too_long": 1}
    assert len(manifest["prompts"]["skipped"]) == 3


def test_score_mode_stores_topk_for_text(tmp_path):
    manifest = run(config_for(tmp_path, "generate.mode=score", "generate.sources=[freshqa]",
                              "generate.max_prompts=6"))
    rows = read_rows(tmp_path)
    assert manifest["complete"] and len(rows) == 6
    for r in rows:
        assert r["mode"] == "score" and len(r["prompt_ids"]) == 1
        assert len(r["teacher_topk_ids"]) == len(r["completion_ids"]) > 0


def test_score_mode_scores_responses_after_the_chat_templated_prompt(tmp_path):
    """Fixed (prompt, response) pairs: the prompt as generation sees it, the response + EOS as the
    completion, each response token labelled; bad rows are reported, not fatal."""
    tokenizer = load_tokenizer("tiny:target")
    pairs = [{"prompt": f"Question {i}?", "response": f"Answer number {i}."} for i in range(6)]
    pairs += [{"prompt": "No answer here?"}, {"prompt": "Too long?", "response": "word " * 1200}]
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "out"
    manifest = run(config_for(out, "generate.mode=score", f"generate.sources=[{source}]",
                              "generate.response_field=response"))
    assert manifest["prompts"]["skipped_by_reason"] == {"empty_response": 1, "response_exceeds_context": 1}
    rows = sorted(read_rows(out), key=lambda r: r["prompt_ids"])
    assert len(rows) == 6
    for r in rows:
        text = tokenizer.decode(r["prompt_ids"])
        i = int(text.split("Question ")[1].split("?")[0])
        assert r["prompt_ids"] == chat_token_ids(tokenizer, f"Question {i}?")
        assert r["completion_ids"] == tokenizer(f"Answer number {i}.", add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id]
        assert r["mode"] == "score" and r["finish_reason"] == "eos"
        assert len(r["teacher_topk_ids"]) == len(r["completion_ids"])


def test_scored_gsm8k_answers_keep_the_questions_split(tmp_path):
    """A GSM8K question keeps its id and split as a plain prompt, so a held-out question's solution is held out."""
    out = tmp_path / "out"
    run(config_for(out, "generate.mode=score", "generate.sources=[gsm8k]", "generate.response_field=answer",
                   "generate.max_prompts=8", "generate.eval_fraction=0.5"))
    plain = {p.prompt_id: p.split for p in load_prompt_set("gsm8k", load_tokenizer("tiny:target"), eval_fraction=0.5)}
    rows = read_rows(out)
    assert rows and all(plain[r["prompt_id"]] == r["split"] for r in rows) and {r["split"] for r in rows} == {"train", "eval"}
    assert clean_gsm8k("She makes 9 * 2 = $<<9*2=18>>18 a day.\n#### 18") == "She makes 9 * 2 = $18 a day.\nThe answer is 18."


@pytest.mark.parametrize("sources, field, error", [
    ("[freshqa]", "answer", "'freshqa' has no responses to score"),
    ("[{file}]", "reply", "no row has the field 'reply'; set generate.response_field"),
])
def test_a_source_without_responses_is_one_clear_error(tmp_path, sources, field, error):
    source = tmp_path / "pairs.jsonl"
    source.write_text(json.dumps({"prompt": "Hi?", "response": "Hello."}) + "\n")
    with pytest.raises(UserError, match=error):
        run(config_for(tmp_path / "out", "generate.mode=score", f"generate.sources={sources.format(file=source)}",
                       f"generate.response_field={field}"))
    assert not (tmp_path / "out" / "plan.json").exists()


def _draft_folder(path, trained_for=None) -> Path:
    """tiny:draft saved as a run's final/ would be: weights, the shared tokenizer, the run's config.yaml."""
    load_model("tiny:draft").save_pretrained(path)
    load_tokenizer("tiny:target").save_pretrained(path)
    if trained_for is not None:
        (Path(path) / "config.yaml").write_text(f"target: {trained_for}\n")
    return Path(path)


def test_rollouts_are_the_drafts_samples_labelled_by_the_target(tmp_path, target):
    """generate.rollout_draft: each completion is the one the draft alone would sample (same seed streams),
    its top-k the target's over that completion; the plan records the draft, and another draft is refused."""
    draft = _draft_folder(tmp_path / "draft", trained_for="tiny:target")
    run(config_for(tmp_path / "rollouts", f"generate.rollout_draft={draft}", *NO_TOP_P))
    run(config_for(tmp_path / "draft-alone", f"target={draft}", *NO_TOP_P))
    key = lambda r: r["prompt_id"]  # noqa: E731
    rollouts = sorted(read_rows(tmp_path / "rollouts"), key=key)
    alone = sorted(read_rows(tmp_path / "draft-alone"), key=key)
    assert [r["completion_ids"] for r in rollouts] == [r["completion_ids"] for r in alone]
    assert [r["teacher_topk_ids"] for r in rollouts] != [r["teacher_topk_ids"] for r in alone]
    for row in rollouts[:4]:
        ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(target(ids).logits[0].float(), -1)[len(row["prompt_ids"]) - 1:-1]
        assert torch.equal(logp.topk(4).indices.int(), torch.tensor(row["teacher_topk_ids"]))
    plan = json.loads((tmp_path / "rollouts" / PLAN_FILE).read_text())
    assert plan["rollout_draft"] == str(draft) and plan["rollout_draft_hash"] and plan["sampler"].startswith("draft-")
    load_model("tiny:target").save_pretrained(draft)  # the same folder, other weights: another draft
    with pytest.raises(ResumeMismatch, match="rollout_draft_hash"):
        run(config_for(tmp_path / "rollouts", f"generate.rollout_draft={draft}", *NO_TOP_P))


@pytest.mark.parametrize("overrides, error", [
    (["generate.rollout_draft={other}"], "was trained for target 'tiny:draft', not 'tiny:target'"),
    (["generate.rollout_draft={missing}"], "generate.rollout_draft: model path .* does not exist"),
    (["generate.rollout_draft={ok}", "generate.mode=score"], "rollout_draft .* needs generate.mode=generate"),
    (["generate.rollout_draft={ok}", "generate.teacher_topk=0"], "rollout_draft: set generate.teacher_topk >= 1"),
])
def test_a_bad_rollout_draft_is_one_error_before_any_shard(tmp_path, overrides, error):
    folders = {"other": _draft_folder(tmp_path / "other", trained_for="tiny:draft"),
               "ok": _draft_folder(tmp_path / "ok"), "missing": tmp_path / "missing"}
    with pytest.raises(UserError, match=error):
        run(config_for(tmp_path / "out", *[o.format(**folders) for o in overrides]))
    assert not (tmp_path / "out" / PLAN_FILE).exists()


# ----------------------------------------------------------------------------- processes


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_two_ranks_cover_every_prompt_once(finished_run, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "distill.generate", "--config", "configs/tiny.yaml", f"generate.out_dir={tmp_path}", *SMALL]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and {r["rank"] for r in manifest["throughput_this_run"]["ranks"]} == {0, 1}
    rows = read_rows(tmp_path)
    assert Counter(Counter(r["prompt_id"] for r in rows).values()) == {1: 24}
    assert {r["prompt_id"] for r in rows} == {r["prompt_id"] for r in read_rows(finished_run)}
