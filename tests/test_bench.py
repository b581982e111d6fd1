"""Smoke tests: `make eval-speedup` end to end on tiny models, and the whole pipeline (`make generate-data`,
`make distill`, `make eval-speedup`)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import ConfigError, load_config
from common.models import load_model
from decode import generate, hf_baselines, speculative_generate
from decode.bench import main
from decode.eval_speedup import setup
from decode.serving import request_groups
from decode.vocab import VocabSubset
from distill.generation.shards import verify_shards


ROOT = Path(__file__).resolve().parents[1]


def make(target: str, *args: str) -> subprocess.CompletedProcess:
    # -o .venv/.installed: the environment exists already (make test created it). One thread: the
    # suite keeps both cores busy, and OpenMP spinning on a taken core makes a stage many times slower.
    result = subprocess.run(["make", "-o", ".venv/.installed", target, "CONFIG=configs/tiny.yaml",
                             "ARGS=" + " ".join(args + ("wandb.mode=offline",))],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def check_report(eval_dir, ks, temperatures, proposers=("draft",)):
    report = json.loads((eval_dir / "report.json").read_text())
    rows = report["results"]
    markdown = (eval_dir / "report.md").read_text()
    assert ({(r["k"], r["temperature"], r["proposer"]) for r in rows}
            == {(k, t, p) for k in ks for t in temperatures for p in proposers})
    for row in rows:
        assert row["speedup"] > 0 and 0 <= row["alpha"] <= 1 and 1 <= row["tau"] <= row["k"] + 1
        assert row["predicted_speedup"] > 0
        per_prompt = row["speedup_per_prompt"]
        assert per_prompt["min"] <= per_prompt["median"] <= per_prompt["max"]
        assert f"{per_prompt['median']:.2f}× ({per_prompt['min']:.2f}–{per_prompt['max']:.2f})" in markdown
        if row["proposer"] == "draft":
            assert row["looked_up"] == 0 and row["draft_steps_per_forward"] <= row["k"]
        if row["temperature"] == 0:
            assert row["greedy_identical"] is True
    assert all(run["greedy_identical"] for run in report["runs"] if run["temperature"] == 0)
    for cost in (report["cost_model"], report["cost_model_end"]):  # before and after the timed runs
        assert cost["c"] > 0 and set(map(int, cost["r"])) == set(range(1, 5))
    reliability = report["timing_reliability"]
    assert set(reliability) == {"reliable", "reasons", "figures", "limits"}
    assert reliability["reliable"] == (not reliability["reasons"])
    # Unreliable timings (tiny models may give them) head report.md and withhold the verdict.
    third_line = markdown.splitlines()[2]
    assert third_line.startswith("Timings reliable:" if reliability["reliable"] else "**Timings unreliable")
    assert ("WITHHELD" in report["verdict"]) == (not reliability["reliable"])
    assert {r["method"] for r in report["hf"]} == {"hf greedy", "hf assisted", "hf prompt lookup"}
    assert report["git_sha"] and report["versions"]["torch"]
    for name in ("report.md", "acceptance_by_position.png", "speedup_vs_k.png", "samples.jsonl"):
        assert (eval_dir / name).stat().st_size > 0
    assert "Speculative vs target-only" in (eval_dir / "report.md").read_text()
    samples = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["method"] for s in samples} >= {"target-only", "speculative k=2", "speculative k=4"}
    return report


@pytest.mark.parametrize("hf_prompts, vs_ours, ours_over_hf", [(1, 5 / 10, 20 / 5), (0, 5 / (20 / 11), 30 / 11 / 5)])
def test_hf_rows_compare_with_our_runs_on_the_same_prompts(hf_prompts, vs_ours, ours_over_hf, monkeypatch):
    """eval.hf_prompts=1 times HF on the first prompt only; its rows then compare with our runs on that
    prompt (a: 10 tok/s target-only, 20 speculative), not with the pooled set (b is ten times slower)."""
    monkeypatch.setattr(hf_baselines, "time_hf_method", lambda s, set_name, prompts, *rest: (5.0, True))
    prompts = [SimpleNamespace(prompt_id="a"), SimpleNamespace(prompt_id="b")]
    s = SimpleNamespace(cfg=SimpleNamespace(eval=SimpleNamespace(hf_prompts=hf_prompts, hf_ks=[4])), draft=None,
                        prompt_sets={"set": prompts})
    runs = [{"prompt_set": "set", "temperature": t, "prompt_id": p, "proposer": "draft", "k": 4,
             "baseline_tokens": 10, "baseline_s": seconds, "speculative_tokens": spec, "speculative_s": seconds}
            for p, seconds, spec in (("a", 1.0, 20), ("b", 10.0, 10)) for t in (0.0, 0.7)]
    rows = hf_baselines.hf_comparisons(s, runs, {})
    assert [(r["method"], r["n_prompts"]) for r in rows] == [("hf greedy", hf_prompts or 2),
                                                              ("hf prompt lookup", hf_prompts or 2)]
    assert all(r["vs_our_baseline"] == pytest.approx(vs_ours) for r in rows)
    assert "ours_over_this" not in rows[0] and rows[1]["ours_over_this"] == pytest.approx(ours_over_hf)



@pytest.mark.parametrize("stage", ["generate-data", "distill"])
def test_a_multi_process_stage_reports_a_bad_setting_once_before_launching(stage):
    """NPROC=2: the config is checked before torchrun starts, so the user sees one error line, not each rank's
    failure inside torchrun's report."""
    result = subprocess.run(["make", "-o", ".venv/.installed", stage, "CONFIG=configs/tiny.yaml", "NPROC=2",
                             "ARGS=distill.lr=abc generate.batch_size=abc"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "expected" in errors[0], result.stderr[-2000:]
    assert "torchrun" not in result.stderr and "ChildFailedError" not in result.stderr

def test_eval_speedup_with_an_untrained_draft(tmp_path):
    result = make("eval-speedup", "draft=tiny:draft", "eval.prompts=[gsm8k]", f"eval.out_dir={tmp_path}",
                  "eval.lookup_ngram=3")
    assert "full report:" in result.stdout
    report = check_report(tmp_path, ks=[2, 4], temperatures=[0.0, 0.7], proposers=("draft", "draft+lookup"))
    assert ("timings unreliable: machine busy" in result.stdout) == (not report["timing_reliability"]["reliable"])
    lookup_rows = [r for r in report["results"] if r["proposer"] == "draft+lookup"]
    # GSM8K questions repeat phrases, so prompt lookup proposes some tokens in place of draft forwards.
    assert sum(r["looked_up"] for r in lookup_rows) > 0
    assert any(r["draft_steps_per_forward"] < r["k"] for r in lookup_rows)
    samples = {json.loads(line)["method"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()}
    assert "speculative k=4 + lookup" in samples
    # The draft comparison script lines reports up: one row per (prompt set, T), best k by speedup.
    table = tmp_path / "comparison.md"
    subprocess.run([sys.executable, str(ROOT / "scripts/compare_drafts.py"), f"untrained={tmp_path}",
                    "--out", str(table)], check=True, capture_output=True, cwd=ROOT)
    rows = [line.split(" | ") for line in table.read_text().splitlines() if line.startswith("| untrained")]
    assert len(rows) == 2
    for row in rows:
        temperature = float(row[4])
        best = max((r for r in report["results"] if r["temperature"] == temperature and r["proposer"] == "draft"),
                   key=lambda r: r["speedup"])
        assert row[8] == str(best["k"]) and row[10].rstrip(" |") == f"{best['speedup']:.2f}×"


def test_generate_distill_eval_pipeline(tmp_path):
    """The three `make` stages on configs/tiny.yaml, each checked where its output is read next."""
    data, run = tmp_path / "data", tmp_path / "run"
    make("generate-data", f"generate.out_dir={data}")
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == 48 and (data / "config.yaml").is_file()
    rows = datasets.load_dataset("parquet", data_files=[str(p) for p in verify_shards(data)], split="train")
    assert len(rows) == 48 and set(rows["split"]) <= {"train", "eval"}
    assert len(rows[0]["teacher_topk_ids"][0]) == 8  # tiny.yaml: teacher_topk 8

    distilled = make("distill", f"distill.data_dirs=[{data}]", f"distill.out_dir={run}")
    final = run / "final"
    metrics = json.loads((final / "metrics.json").read_text())
    assert 0 <= metrics["final/alpha"] <= 1 and metrics["final/tau_k4"] >= 1
    assert (run / "wandb_run_id").exists() and (final / "config.yaml").exists()
    # The tiny config's subset draft spreads its "other" row by default, so it leaves ready for serving engines.
    assert (run / "export/hf/export.json").is_file() and "export skipped" not in distilled.stdout
    draft = AutoModelForCausalLM.from_pretrained(final).eval()
    assert VocabSubset.from_config(draft.config).size == 512
    target, prompt = load_model("tiny:target"), torch.tensor([[1, 400, 401, 402]])
    assert speculative_generate(target, draft, prompt, k=4, max_new_tokens=8, backend="hf").tokens.tolist() == \
        generate(target, prompt, max_new_tokens=8, backend="hf").tolist()

    make("eval-speedup", f"generate.out_dir={data}", f"draft={final}", f"distill.out_dir={run}")
    report = check_report(run / "eval", ks=[2, 4], temperatures=[0.0, 0.7])
    assert report["draft"]["vocab_subset"] == 512
    # The report says how make distill trained what it measured (configs/tiny.yaml: 6 steps of 4, subset 512).
    recipe = [line for line in (run / "eval/report.md").read_text().splitlines() if "trained by" in line]
    assert recipe == [f"- draft trained by `make distill`: forward_kl, 6 steps of 4 prompts (per rank); on {data}; "
                      f"512-token subset; {report['draft']['recipe']['seconds']:.0f} s of training on "
                      f"{report['draft']['recipe']['machine']}"]
    assert list(report["prompt_sets"]) == ["data:eval"]


def test_a_draft_not_smaller_than_the_target_warns():
    # RELIABILITY 23: the target as its own draft can never speed it up.
    cfg = load_config("configs/tiny.yaml", ["draft=tiny:target", "eval.prompts=[gsm8k]"])
    with pytest.warns(UserWarning, match=r"the draft \([\d,]+ params\) is not smaller than the target"):
        setup(cfg)


def test_serving_table_at_several_batch_sizes(tmp_path, one_thread, capsys):
    report = main(["--config", "configs/tiny.yaml", "draft=tiny:draft", "eval.prompts=[gsm8k]", "eval.num_prompts=3",
                   "eval.ks=[2]", "eval.hf_baselines=false", "eval.warmup=0", "eval.max_new_tokens=8",
                   "eval.serving_batches=[1, 3]", "eval.serving_p_min=0.3", "eval.serving_requests=8",
                   "eval.lookup_ngram=2", f"eval.out_dir={tmp_path}", "wandb.mode=disabled"])
    rows = report["serving"]["rows"]
    methods = ("target-only", "draft", "draft p_min", "draft auto", "draft+lookup", "draft+lookup p_min",
               "draft+lookup auto")
    assert {(r["batch"], r["temperature"], r["method"]) for r in rows} == {
        (b, t, m) for b in (1, 3) for t in (0.0, 0.7) for m in methods}
    for r in rows:
        # batch 1: 4 groups of 2 requests, the methods taking turns; batch 3: one group
        assert r["requests"] == 8 and r["tokens"] > 0 and r["mean_latency_s"] > 0
        assert r["greedy_identical"] is (True if r["temperature"] == 0 else None)  # outputs in request order
        if r["method"] == "target-only":
            assert r["speedup"] == 1.0 and r["tau"] == 1.0
        else:
            assert 1.0 <= r["tau"] <= 3.0
    markdown = (tmp_path / "report.md").read_text()
    assert "## Serving (batch > 1)" in markdown and (tmp_path / "serving.png").stat().st_size > 0
    assert set(report["serving"]["pays_up_to"]) == {0.0, 0.7}
    # The bar counts every request each method decodes: 2 batch sizes x 2 temperatures x 7 methods x 8 requests,
    # its first unit batch 1's first group of 2.
    assert "eval-speedup serving: the first 2 of 224 requests took" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:eval.dtype=bf16 on a device without native bf16")
def test_a_bf16_target_on_a_cpu_decodes_beside_an_fp32_draft(tmp_path, one_thread):
    """The standalone draft stays fp32 on a CPU (its dtype moves what it proposes, never what the target accepts):
    greedy rows still equal target-only, and HF's assisted generation takes the mixed pair."""
    report = main(["--config", "configs/tiny.yaml", "draft=tiny:draft", "eval.prompts=[gsm8k]", "eval.num_prompts=2",
                   "eval.ks=[2]", "eval.temperatures=[0.0]", "eval.warmup=0", "eval.max_new_tokens=8",
                   "eval.hf_prompts=1", "eval.dtype=bf16", "device=cpu", f"eval.out_dir={tmp_path}",
                   "wandb.mode=disabled"])
    assert report["dtype"]["dtype"] == "bf16" and report["draft"]["dtype"] == "fp32"
    assert all(row["greedy_identical"] for row in report["results"])
    assert [row["method"] for row in report["hf"]] == ["hf greedy", "hf assisted", "hf prompt lookup"]
    assert "49.14% of the target, fp32)" in (tmp_path / "report.md").read_text()


def test_request_groups_cover_every_request_once_in_order():
    assert request_groups(16, 1) == [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    assert request_groups(9, 2) == [range(0, 4), range(4, 9)]  # groups of at least two batches
    assert request_groups(8, 3) == [range(0, 8)]


@pytest.mark.parametrize("stage, stop", [("serving", RuntimeError("out of memory at batch 64")),
                                         ("serving", KeyboardInterrupt()), ("second prompt", KeyboardInterrupt())])
def test_a_stopped_run_keeps_the_runs_it_measured(tmp_path, monkeypatch, one_thread, stage, stop):
    """Stopped in the serving table, every batch-1 row is there; stopped in the batch-1 loop, the first prompt's."""
    from decode import eval_speedup
    measured = eval_speedup.measure_prompt

    def stopping(*args, **kwargs):
        if stage == "second prompt" and args[4]:  # runs (args[4]) already hold the first prompt's
            raise stop
        return measured(*args, **kwargs)

    def serving_stops(*args):
        raise stop

    monkeypatch.setattr("decode.eval_speedup.measure_prompt", stopping)
    monkeypatch.setattr("decode.eval_speedup.measure_serving", serving_stops)
    with pytest.raises(type(stop)):
        main(["--config", "configs/tiny.yaml", "draft=tiny:draft", "eval.prompts=[gsm8k]", "eval.num_prompts=2",
              "eval.ks=[2]", "eval.temperatures=[0.0]", "eval.hf_baselines=false", "eval.warmup=0",
              "eval.max_new_tokens=8", "eval.serving_batches=[4]", f"eval.out_dir={tmp_path}", "wandb.mode=disabled"])
    report = json.loads((tmp_path / "report.json").read_text())
    prompts_measured = 1 if stage == "second prompt" else 2
    assert [(r["proposer"], r["k"], r["n_prompts"]) for r in report["results"]] == [("draft", 2, prompts_measured)]
    assert report["results"][0]["greedy_identical"] and report["serving"] is None
    assert type(stop).__name__ in report["stopped"]
    assert "**Stopped early:** the run stopped" in (tmp_path / "report.md").read_text()


def test_serving_refuses_a_batch_beyond_free_memory(tmp_path, monkeypatch):
    monkeypatch.setattr("decode.batched_speculative.os.sysconf", lambda name: 1)  # one byte free
    with pytest.raises(ConfigError, match=r"eval.serving_batches: batch 4 needs ~.* GiB of cache"):
        main(["--config", "configs/tiny.yaml", "draft=tiny:draft", "eval.prompts=[gsm8k]", "eval.serving_batches=[4]",
              f"eval.out_dir={tmp_path}", "wandb.mode=disabled"])


@pytest.mark.filterwarnings("ignore:eval.dtype=bf16 on a device without native bf16")
def test_a_bf16_serving_table_on_a_cpu_matches_batch_1_target_only(tmp_path, one_thread):
    """bf16 rows at batch > 1 decode the same greedy text as batch-1 target-only in bf16 (the ragged runner gives each
    row the bits of a one-token batch-1 forward), so the serving table runs in bf16 rather than being refused."""
    report = main(["--config", "configs/tiny.yaml", "draft=tiny:draft", "eval.prompts=[gsm8k]", "eval.num_prompts=2",
                   "eval.ks=[2]", "eval.temperatures=[0.0]", "eval.hf_baselines=false", "eval.warmup=0",
                   "eval.max_new_tokens=8", "eval.serving_batches=[3]", "eval.serving_requests=6", "eval.dtype=bf16",
                   "device=cpu", f"eval.out_dir={tmp_path}", "wandb.mode=disabled"])
    assert report["dtype"]["dtype"] == "bf16"
    rows = report["serving"]["rows"]
    assert rows and all(r["batch"] == 3 and r["greedy_identical"] is True for r in rows)
