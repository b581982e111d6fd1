"""generate.engine=vllm (distill/generation/vllm_*.py, engine_choice.py, equivalence.py).

The main suite checks the logic and the whole process path with a fake vLLM (tests/fake_vllm, on
the worker's PYTHONPATH, standing in for vllm.LLM). Tests marked `vllm` run the real vLLM
environment on the embedded target end to end: `make test-vllm` runs exactly those and fails,
never skips, when that environment is missing (SPEC_DISTILL_REQUIRE_VLLM).
"""

import functools
import hashlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config import ConfigError, load_config
from common.models import embedded_dir
from distill.generation.run import load_runner, run
from distill.generation import vllm_wire as wire
from distill.generation.engine_choice import choose_engine
from distill.generation.equivalence import compare_rows, compare_topk
from distill.generation.plan import PLAN_FILE, ResumeMismatch
from distill.generation.shards import SCHEMA, TOPK_FIELDS, verify_shards
from distill.generation.vllm_engine import llm_kwargs
from distill.generation.vllm_process import VllmFailed, VllmUnavailable, gpu_share, installed_version, worker_env
from distill.generation.vllm_worker import answer, serve, topk_arrays


ROOT = Path(__file__).resolve().parents[1]
FAKE_VLLM = ROOT / "tests" / "fake_vllm"
# The embedded target, 12 short prompts in 3 shards; batch_size 2 makes vLLM windows of 8 rows,
# which straddle shards. teacher_topk 32 is above vLLM's default max_logprobs (20).
FAKE_PROMPTS = [f"Question {i}: what is {i} + {i}?" for i in range(12)]
FAKE_RUN = ["generate.engine=vllm", f"generate.vllm.python={sys.executable}", "generate.shard_size=4",
            "generate.batch_size=2", "generate.max_new_tokens=8", "generate.teacher_topk=32",
            "wandb.mode=disabled"]


def config_for(out_dir, *overrides):
    """The demo preset with generate.dtype resolved, as generate-data hands it to the engine."""
    return load_config(ROOT / "configs/smollm2.yaml", [f"generate.out_dir={out_dir}", "generate.dtype=bf16", *overrides])


def read_rows(out_dir) -> list[dict]:
    return [row for path in sorted(Path(out_dir).glob("shard-*.parquet")) for row in pq.read_table(path).to_pylist()]


def load_fake_vllm():
    spec = importlib.util.spec_from_file_location("fake_vllm", FAKE_VLLM / "vllm" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory):
    """The fake on the worker's path and its settings: the overrides of a fake run (its prompts
    file included) and the file where each LLM(...) records its arguments."""
    folder = tmp_path_factory.mktemp("fake_vllm")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in FAKE_PROMPTS))
    record = folder / "llm_kwargs.jsonl"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAKE_VLLM), os.environ.get("PYTHONPATH")])))
        env.setenv("FAKE_VLLM_RECORD", str(record))
        yield SimpleNamespace(overrides=[*FAKE_RUN, f"generate.sources=[{prompts}]"], record=record)


# ----------------------------------------------------------------------------- the worker's side


def flat(positions: list[list[int]], logprobs: list[list[float]]):
    starts = np.cumsum([0] + [len(p) for p in positions[:-1]]).tolist()
    return SimpleNamespace(start_indices=starts, end_indices=[s + len(p) for s, p in zip(starts, positions)],
                           token_ids=sum(positions, []), logprobs=sum(logprobs, []))


def test_topk_arrays_skip_the_chosen_token():
    # Position 0: chosen 9 (outside the top 2); position 1: chosen 4, also ranked first.
    out = flat([[9, 4, 5], [4, 4, 6]], [[-7.0, -0.1, -2.0], [-0.3, -0.3, -1.5]])
    ids, logprobs = topk_arrays(out, 0, 2)
    assert ids.tolist() == [[4, 5], [4, 6]] and ids.dtype == np.int32
    np.testing.assert_allclose(logprobs, [[-0.1, -2.0], [-0.3, -1.5]])
    assert topk_arrays(out, 1, 2)[0].tolist() == [[4, 6]]  # prompt logprobs: positions from the completion on
    with pytest.raises(RuntimeError, match="the top 3"):
        topk_arrays(out, 0, 3)


def test_answer_generates_and_scores_with_the_fake():
    fake = load_fake_vllm()
    llm = fake.LLM(model="m")
    rows = [{"prompt_ids": [1, 5, 9], "seed": 11}, {"prompt_ids": [1, 7], "seed": 12}]
    sampling = {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "max_tokens": 6, "stop_token_ids": [2]}
    generated = answer(llm, fake.SamplingParams, {"generate": rows, "sampling": sampling, "teacher_topk": 5})
    completions = generated["completions"]
    assert len(completions) == 2
    for row, c in zip(rows, completions):
        ids, topk_ids = wire.unpack(c["ids"]), wire.unpack(c["topk_ids"])
        assert topk_ids.shape == (len(ids), 5) and 1 <= len(ids) <= 6
        assert topk_ids[0].tolist() == fake.fake_topk(row["prompt_ids"], 5)[0]
    # Teacher-forcing the same completions (score mode, prompt logprobs) gives the same top-5.
    scored = answer(llm, fake.SamplingParams, {"score": [{"prompt_ids": r["prompt_ids"],
                                                          "completion_ids": wire.unpack(c["ids"]).tolist()}
                                                         for r, c in zip(rows, completions)], "teacher_topk": 5})
    for g, s in zip(completions, scored["completions"]):
        assert np.array_equal(wire.unpack(g["ids"]), wire.unpack(s["ids"]))
        assert np.array_equal(wire.unpack(g["topk_ids"]), wire.unpack(s["topk_ids"]))
        assert np.array_equal(wire.unpack(g["topk_logprobs"]), wire.unpack(s["topk_logprobs"]))


def test_serve_answers_until_the_pipe_closes_and_reports_a_failure():
    fake = load_fake_vllm()
    inbox = io.BytesIO()
    request = {"score": [{"prompt_ids": [1], "completion_ids": [5, 6]}], "teacher_topk": 3}
    wire.send(inbox, request)
    wire.send(inbox, request)
    inbox.seek(0)
    outbox = io.BytesIO()
    serve(fake.LLM(model="m"), fake.SamplingParams, inbox, outbox)
    outbox.seek(0)
    replies = [wire.receive(outbox), wire.receive(outbox)]
    assert all(wire.unpack(r["completions"][0]["topk_ids"]).shape == (2, 3) for r in replies)
    # A request that fails is answered with one line, then raised (the traceback goes to the log).
    inbox, outbox = io.BytesIO(), io.BytesIO()
    wire.send(inbox, {"generate": [{"prompt_ids": [1], "seed": 3}], "teacher_topk": 2})  # no "sampling"
    inbox.seek(0)
    with pytest.raises(KeyError):
        serve(fake.LLM(model="m"), fake.SamplingParams, inbox, outbox)
    outbox.seek(0)
    assert wire.receive(outbox)["error"] == "KeyError: 'sampling'"


# ----------------------------------------------------------------------------- settings and environment


def test_llm_kwargs_pass_the_scale_knobs_through():
    config = config_for("x", "generate.vllm.tensor_parallel_size=2", "generate.vllm.pipeline_parallel_size=3",
                        "generate.vllm.max_model_len=512", "generate.batch_size=16",
                        "generate.vllm.llm_args={enforce_eager: true}")
    cpu = llm_kwargs(config, "/m", cpu=True)
    assert cpu["max_logprobs"] == 32 and cpu["max_num_seqs"] == 16 and cpu["dtype"] == "bfloat16"
    assert (cpu["tensor_parallel_size"], cpu["pipeline_parallel_size"], cpu["max_model_len"]) == (2, 3, 512)
    assert cpu["kv_cache_memory_bytes"] == 1 << 30 and cpu["enforce_eager"] is True
    gpu = llm_kwargs(config_for("x", "generate.vllm.gpu_memory_utilization=0.8"), "/m", cpu=False)
    assert gpu["gpu_memory_utilization"] == 0.8 and "kv_cache_memory_bytes" not in gpu
    assert cpu["enable_chunked_prefill"] is False and "enable_chunked_prefill" not in gpu
    chunked = llm_kwargs(config_for("x", "generate.vllm.llm_args={enable_chunked_prefill: true}"), "/m", cpu=True)
    assert chunked["enable_chunked_prefill"] is True
    with pytest.raises(ConfigError, match="llm_args sets max_num_seqs"):
        llm_kwargs(config_for("x", "generate.vllm.llm_args={max_num_seqs: 4}"), "/m", cpu=True)


@pytest.mark.parametrize("override, problem", [
    ("generate.engine=vlm", "did you mean 'vllm'"),
    ("generate.vllm.tensor_parallel_size=0", "tensor_parallel_size must be >= 1"),
    ("generate.vllm.gpu_memory_utilization=1.5", "outside (0, 1]"),
    ("generate.vllm.max_model_len=-1", "max_model_len must be >= 0"),
])
def test_bad_engine_settings_are_refused(override, problem):
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        config_for("x", override)


def test_each_rank_gets_its_own_gpus():
    visible = [str(i) for i in range(8)]
    assert gpu_share(visible, 1, 4) == ["4", "5", "6", "7"]
    assert gpu_share(visible, 7, 1) == ["7"]
    with pytest.raises(VllmUnavailable, match="needs 4 GPUs"):
        gpu_share(visible, 2, 4)


def test_worker_env_on_cpu(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = worker_env(str(venv / "bin" / "python"), cpu=True, gpus_per_instance=1)
    assert env["LD_PRELOAD"].split()[0] == str(venv / "lib" / "libiomp5.so")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and int(env["OMP_NUM_THREADS"]) >= 1
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_engine_choice(tmp_path, fake_vllm):
    missing = f"generate.vllm.python={tmp_path / 'none' / 'python'}"
    auto = "generate.engine=auto"
    choose = functools.partial(choose_engine, cpu=False)  # on GPUs auto prefers vLLM
    assert choose(config_for(tmp_path, "generate.engine=project")).name == "project"
    with pytest.raises(VllmUnavailable, match="make setup-vllm"):
        choose(config_for(tmp_path, "generate.engine=vllm", missing))
    chosen = choose(config_for(tmp_path, auto, missing))
    assert chosen.name == "project" and "make setup-vllm" in chosen.reason
    here = f"generate.vllm.python={sys.executable}"  # with the fake on PYTHONPATH it "has" vLLM
    assert installed_version(sys.executable) == "0.0.0+fake"
    assert choose(config_for(tmp_path, auto, here)).name == "vllm"
    assert choose(config_for(tmp_path, auto, here, "target=tiny:target")).name == "project"
    # auto keeps a folder with the engine that started it (plans older than engines: the project's).
    (tmp_path / PLAN_FILE).write_text(json.dumps({"seed": 0}))
    assert choose(config_for(tmp_path, auto, here)).name == "project"
    (tmp_path / PLAN_FILE).write_text(json.dumps({"engine": "vllm"}))
    assert choose(config_for(tmp_path, auto, here)).name == "vllm"
    with pytest.raises(VllmUnavailable, match="was started with vLLM"):
        choose(config_for(tmp_path, auto, missing))
    # On CPU auto is the project engine; a folder vLLM started stays vLLM's.
    assert choose_engine(config_for(tmp_path, auto, here), cpu=True).name == "vllm"
    (tmp_path / PLAN_FILE).unlink()
    chosen = choose_engine(config_for(tmp_path, auto, here), cpu=True)
    assert chosen.name == "project" and "generate.engine=vllm" in chosen.reason
    assert choose_engine(config_for(tmp_path, "generate.engine=vllm", here), cpu=True).name == "vllm"


# ----------------------------------------------------------------------------- whole runs, fake vLLM


@pytest.fixture(scope="module")
def fake_run(fake_vllm, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fake_run")
    return out_dir, run(config_for(out_dir, *fake_vllm.overrides))


def test_fake_vllm_run_writes_the_project_engines_shards(fake_run, fake_vllm, tmp_path):
    out_dir, manifest = fake_run
    assert manifest["complete"] and manifest["rows"] == 12 and len(verify_shards(out_dir)) == 3
    assert manifest["fingerprint"]["engine"] == "vllm"
    assert manifest["fingerprint"]["sampler"] == "vllm-0.0.0+fake-row-seed"
    expected = pa.schema(list(SCHEMA) + [pa.field(n, t) for n, t in TOPK_FIELDS])
    assert all(pq.read_schema(p).remove_metadata().equals(expected) for p in out_dir.glob("shard-*.parquet"))
    rows = read_rows(out_dir)
    assert sorted(Counter(r["prompt_id"] for r in rows).values()) == [1] * 12
    for r in rows:
        assert (r["finish_reason"] == "eos") == (r["completion_ids"][-1] == 2)
        assert r["finish_reason"] == "eos" or len(r["completion_ids"]) == 8
        topk = np.array(r["teacher_topk_logprobs"])
        assert topk.shape == (len(r["completion_ids"]), 32) and (np.diff(topk, axis=1) <= 0).all()
    kwargs = json.loads(fake_vllm.record.read_text().splitlines()[0])
    assert kwargs["model"] == str(embedded_dir()) and kwargs["max_logprobs"] == 32 and kwargs["max_num_seqs"] == 2
    # Seeds are per row, not per batch position: another batch size gives the same completions.
    run(config_for(tmp_path / "batch5", *fake_vllm.overrides, "generate.batch_size=5"))
    key = lambda r: r["prompt_id"]  # noqa: E731
    assert sorted(rows, key=key) == sorted(read_rows(tmp_path / "batch5"), key=key)


def test_fake_vllm_resume_and_engine_switch(fake_run, fake_vllm, tmp_path):
    out_dir, _ = fake_run
    first = run(config_for(tmp_path, *fake_vllm.overrides, "generate.stop_after_shards=1"))
    assert not first["complete"] and len(first["shards"]) == 1
    second = run(config_for(tmp_path, *fake_vllm.overrides))
    assert second["complete"] and read_rows(tmp_path) == read_rows(out_dir)
    starts = len(fake_vllm.record.read_text().splitlines())
    run(config_for(tmp_path, *fake_vllm.overrides))  # nothing left to do: vLLM is not started
    assert len(fake_vllm.record.read_text().splitlines()) == starts
    with pytest.raises(ResumeMismatch, match=r"engine: 'vllm' -> 'project'"):
        run(config_for(tmp_path, *fake_vllm.overrides, "generate.engine=project"))


def test_fake_vllm_skips_prompts_longer_than_max_model_len(tmp_path, fake_vllm):
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": t}) for t in ["Hi there.", "long " * 100, "What is 3 * 4?"]))
    manifest = run(config_for(tmp_path / "out", *fake_vllm.overrides, f"generate.sources=[{source}]",
                              "generate.vllm.max_model_len=64"))
    assert manifest["complete"] and manifest["rows"] == 2
    assert manifest["prompts"]["skipped_by_reason"] == {"exceeds_context": 1}


def test_a_target_vllm_cannot_load_is_one_line_and_leaves_the_folder_free(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_LOAD", "1")
    with pytest.raises(VllmFailed, match="could not load target 'embedded:smollm2-135m-instruct'") as error:
        run(config_for(tmp_path, *fake_vllm.overrides))
    assert "\n" not in str(error.value) and "unsupported architecture" in str(error.value)
    assert not (tmp_path / PLAN_FILE).exists() and not list(tmp_path.glob("shard-*"))
    monkeypatch.delenv("FAKE_VLLM_FAIL_LOAD")
    monkeypatch.setenv("FAKE_VLLM_BROKEN_IMPORT", "1")
    with pytest.raises(VllmUnavailable, match="does not import.*torchvision::nms.*make setup-vllm"):
        run(config_for(tmp_path, *fake_vllm.overrides))


# ----------------------------------------------------------------------------- equivalence metrics


def test_compare_topk_measures_agreement():
    rng = np.random.default_rng(0)
    ids = np.argsort(-rng.random((50, 8)), axis=1)
    logprobs = np.sort(rng.normal(-3, 1, (50, 8)), axis=1)[:, ::-1]
    same = compare_topk(ids, logprobs, logprobs, ids[:, 0])
    assert same["mean_kl"] == pytest.approx(0, abs=1e-12) and same["top1_agreement"] == 1.0
    assert same["tokens"] == 50
    shuffled = compare_topk(ids, logprobs, logprobs[:, ::-1], ids[:, 1])
    assert shuffled["mean_kl"] > 0.5 and shuffled["top1_agreement"] == 0.0


# ----------------------------------------------------------------------------- end to end, real vLLM
# `make test-vllm`. 20 embedded prompts in 5 shards of 4; batch_size 1 makes one vLLM call per shard,
# so a kill lands between shards. Each test starts vLLM anew: enforce_eager skips its torch.compile
# warm-up (start-up 108 s instead of 350 s on the busy 2-core machine).

E2E = ["generate.engine=vllm", "generate.max_prompts=20", "generate.shard_size=4", "generate.batch_size=1",
       "generate.max_new_tokens=16", "generate.teacher_topk=8", "generate.vllm.llm_args={enforce_eager: true}",
       "wandb.mode=disabled"]
# bf16 vLLM against the project engine's bf16 GEMMs, per completion token (the smoke run measured
# these; fp32 against fp32 is far closer).
MAX_MEAN_KL = 0.02
MIN_TOP1_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def vllm_python():
    python = os.environ.get("SPEC_DISTILL_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    if installed_version(python) is None:
        message = f"no vLLM environment at {python}: run make setup-vllm"
        if os.environ.get("SPEC_DISTILL_REQUIRE_VLLM"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def killed_and_resumed(vllm_python, tmp_path_factory):
    """A vLLM run killed (the whole process group, SIGKILL) after its first shard, then resumed."""
    out_dir = tmp_path_factory.mktemp("vllm")
    args = [f"generate.out_dir={out_dir}", f"generate.vllm.python={vllm_python}", *E2E]
    cmd = [sys.executable, "-m", "distill.generate", "--config", "configs/smollm2.yaml", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.monotonic() + 900
    while not (out_dir / "shard-00000.parquet").exists():
        assert process.poll() is None, f"generate-data exited with {process.returncode} before its first shard"
        assert time.monotonic() < deadline, "no shard after 15 minutes"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = {p.name: sha256(p) for p in out_dir.glob("shard-*.parquet")}
    assert len(before) < 5 and not (out_dir / "manifest.json").exists(), "the run finished before the kill"
    manifest = run(load_config(ROOT / "configs/smollm2.yaml", args))
    return out_dir, before, manifest


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_killed_run_resumes_to_the_project_schema(killed_and_resumed, tmp_path):
    out_dir, before, manifest = killed_and_resumed
    assert manifest["complete"] and manifest["rows"] == 20 and len(verify_shards(out_dir)) == 5
    assert manifest["fingerprint"]["engine"] == "vllm" and manifest["fingerprint"]["sampler"].startswith("vllm-")
    assert all(sha256(out_dir / name) == digest for name, digest in before.items())  # shards before the kill kept
    rows = read_rows(out_dir)
    assert sorted(Counter(r["prompt_id"] for r in rows).values()) == [1] * 20
    assert all((r["finish_reason"] == "eos") == (r["completion_ids"][-1] == 2) for r in rows)
    # The project engine's shards for the same settings have the same schema, column for column.
    project = tmp_path / "project"
    run(load_config(ROOT / "configs/smollm2.yaml", [f"generate.out_dir={project}", *E2E,
                                                     "generate.engine=project", "generate.max_prompts=4"]))
    assert pq.read_schema(next(project.glob("shard-*.parquet"))).remove_metadata().equals(
        pq.read_schema(out_dir / "shard-00000.parquet").remove_metadata())


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_logprobs_match_the_project_engine(killed_and_resumed):
    out_dir, _, _ = killed_and_resumed
    _, runner = load_runner(load_config(ROOT / "configs/smollm2.yaml"), "cpu")
    agreement = compare_rows(runner, read_rows(out_dir))
    print(agreement)
    assert agreement["mean_kl"] < MAX_MEAN_KL and agreement["top1_agreement"] >= MIN_TOP1_AGREEMENT, agreement


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_score_mode_matches_the_project_engine(vllm_python, tmp_path):
    manifest = run(load_config(ROOT / "configs/smollm2.yaml", [
        f"generate.out_dir={tmp_path}", f"generate.vllm.python={vllm_python}", *E2E, "generate.mode=score",
        "generate.sources=[freshqa]", "generate.max_prompts=6", "generate.batch_size=8"]))
    assert manifest["complete"] and manifest["rows"] == 6
    _, runner = load_runner(load_config(ROOT / "configs/smollm2.yaml"), "cpu")
    agreement = compare_rows(runner, read_rows(tmp_path))
    print(agreement)
    assert agreement["mean_kl"] < MAX_MEAN_KL and agreement["top1_agreement"] >= MIN_TOP1_AGREEMENT, agreement
