"""`make eval-engines` (decode/engines/): what runs without vLLM or llama.cpp installed: parsing what
llama.cpp's tools print (fixtures captured from the built tools), vLLM's speculative counters ->
acceptance, report rows and tables, clear errors when an engine or an export is missing, and the HF
engine end to end on tiny models. llama.cpp's built tools run in `test_llamacpp_tools_end_to_end`
(skipped where `make setup-llamacpp` has not built them); vLLM, whose every start takes minutes, runs
in `make eval-engines` only."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.cli import run_cli
from common.config import load_config
from common.errors import UserError
from common.models import load_model
from decode.engines.__main__ import add_to_report, main
from decode.engines.exports import MissingExportError, draft_gguf, draft_hf, draft_kind, target_gguf
from decode.engines.job import EngineJob
from decode.engines.llamacpp_engine import LlamaCppTools, command, llamacpp_tools
from decode.engines.llamacpp_output import LlamaCppOutputError, parse_plain, parse_speculative, verbose_prompt_ids
from decode.engines.rows import EngineRun, engine_rows, outputs_agree
from decode.engines.target_logprob import token_logprobs
from decode.engines.vllm_engine import runs_from_result, speculative_config, vllm_python
from decode.engines.vllm_worker import ACCEPTED, DRAFT_TOKENS, DRAFTS, acceptance_counts, serve, spec_counters
from decode.report import engine_lines


FIXTURES = Path(__file__).with_name("fixtures") / "llamacpp"
ROOT = Path(__file__).resolve().parents[1]


def run(mode, outputs, seconds, tokens=None, temperature=0.0, accepted=None, drafted=None, engine="e", k=4):
    tokens = tokens or [len(o) for o in outputs]
    return EngineRun(engine, "set", mode, None if mode == "plain" else k, temperature, tokens, seconds, outputs,
                     accepted, drafted)


# --- rows -----------------------------------------------------------------------------------------

def test_rows_speedup_acceptance_and_greedy_check_against_the_same_engine():
    plain = run("plain", [[1, 2, 3, 4], [5, 6]], [2.0, 1.0])
    draft = run("draft", [[1, 2, 3, 4], [5, 6]], [1.0, 0.5], accepted=3, drafted=4)
    wrong = run("ngram", [[1, 2, 9, 4], [5, 6]], [1.0, 0.5], accepted=0, drafted=0)
    sampled = run("draft", [[7, 7, 7, 7], [8, 8]], [1.0, 0.5], temperature=0.7, accepted=1, drafted=4)
    rows = {(r["mode"], r["temperature"]): r for r in engine_rows([plain, draft, wrong, sampled])}
    assert rows[("plain", 0.0)]["tok_s"] == pytest.approx(2.0) and rows[("plain", 0.0)]["greedy_identical"] is None
    assert rows[("draft", 0.0)]["speedup"] == pytest.approx(2.0)
    assert rows[("draft", 0.0)]["alpha"] == pytest.approx(0.75)
    assert rows[("draft", 0.0)]["tau"] == pytest.approx(6 / 3)  # 6 tokens from 6 - 3 target forwards
    assert rows[("draft", 0.0)]["greedy_identical"] is True
    assert rows[("ngram", 0.0)]["greedy_identical"] is False
    assert rows[("ngram", 0.0)]["alpha"] is None and rows[("ngram", 0.0)]["tau"] == pytest.approx(1.0)
    # No plain run at T = 0.7 and no greedy check when sampling.
    assert rows[("draft", 0.7)]["speedup"] is None and rows[("draft", 0.7)]["greedy_identical"] is None


def test_outputs_agree_over_the_common_length_only():
    assert outputs_agree("the cat sat", "the cat sat on")  # llama-speculative runs up to k tokens past -n
    assert not outputs_agree("the cat sat", "the dog sat on")
    assert outputs_agree([], []) and not outputs_agree([], [1])


def test_engine_table_in_the_report():
    rows = engine_rows([run("plain", [[1, 2]], [1.0], engine="vllm"),
                        run("draft", [[1, 3]], [0.5], engine="vllm", accepted=1, drafted=4)])
    rows[1]["notes"], rows[1]["target_logprob"] = ["vLLM 0.32.0, float32"], -1.234
    setup = {"command": "python -m decode.engines", "date": "today", "threads": 2, "files": {"draft": "d/hf"}}
    table = "\n".join(engine_lines(rows, setup))
    assert "## Serving engines" in table and "- draft: d/hf" in table
    assert "| vllm | set (1) | 0.0 | 1 | plain | – | 2.0 | – | – | – | 1.00 | – | – |  |" in table
    assert ("| vllm | set (1) | 0.0 | 1 | draft | 4 | 4.0 | **2.00×** | 0.25 | 2.00 | 0.50 | **NO** | -1.23 | "
            "vLLM 0.32.0, float32 |") in table


def batched(mode, outputs, latencies, wall_s, batch, **kwargs):
    served = run(mode, outputs, latencies, **kwargs)
    served.batch, served.wall_s = batch, wall_s
    return served


def test_batched_rows_against_plain_at_their_batch_and_greedy_against_batch_1():
    plain_1 = run("plain", [[1, 2, 3], [4, 5, 6]], [1.0, 1.0])
    # Four requests: prompts 0, 1, 0, 1. Throughput counts the wall-clock of all, not the latencies' sum.
    plain_4 = batched("plain", [[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]], [2.0] * 4, 4.0, 4)
    draft_4 = batched("draft", [[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]], [1.0] * 4, 2.0, 4,
                      accepted=6, drafted=8)
    wrong_4 = batched("ngram", [[1, 2, 3], [4, 5, 6], [4, 5, 6], [4, 5, 6]], [1.0] * 4, 2.0, 4)
    rows = {(r["mode"], r["batch"]): r for r in engine_rows([plain_1, plain_4, draft_4, wrong_4])}
    assert rows[("plain", 4)]["tok_s"] == pytest.approx(12 / 4.0) and rows[("plain", 4)]["speedup"] == 1.0
    assert rows[("draft", 4)]["speedup"] == pytest.approx(2.0) and rows[("draft", 4)]["mean_latency_s"] == 1.0
    assert rows[("draft", 4)]["tau"] == pytest.approx(12 / 6)
    assert rows[("plain", 4)]["greedy_identical"] is True and rows[("draft", 4)]["greedy_identical"] is True
    assert rows[("ngram", 4)]["greedy_identical"] is False  # request 2 got prompt 1's output
    assert rows[("plain", 1)]["greedy_identical"] is None  # the reference itself


def test_batched_engine_rows_are_plotted_by_batch(tmp_path):
    cfg = load_config("configs/tiny.yaml")
    setup = {"command": "c", "date": "d", "threads": 1, "files": {}, "export_dir": "runs/x/export"}
    rows = engine_rows([run("plain", [[1]], [1.0]), run("draft", [[1]], [0.5], accepted=0, drafted=1)])
    (tmp_path / "one").mkdir()
    add_to_report(tmp_path / "one", cfg, rows, setup)
    assert not (tmp_path / "one" / "engines_serving.png").exists()  # batch 1 only: nothing to plot
    rows += engine_rows([batched("plain", [[1], [1]], [1.0, 1.0], 1.0, 2),
                         batched("draft", [[1], [1]], [0.5, 0.5], 0.5, 2, accepted=0, drafted=1)])
    (tmp_path / "two").mkdir()
    add_to_report(tmp_path / "two", cfg, rows, setup)
    assert (tmp_path / "two" / "engines_serving.png").stat().st_size > 0


def test_engine_rows_join_an_existing_report_without_replacing_it(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"config": {"name": "x", "draft": "d", "target": "t",
                                                                 "eval": {"max_new_tokens": 8}},
                                                      "git_sha": "abc", "hf": ["kept"]}))
    cfg = load_config("configs/tiny.yaml")
    setup = {"command": "c", "date": "d", "threads": 1, "files": {}, "export_dir": "runs/x/export"}
    add_to_report(tmp_path, cfg, engine_rows([run("plain", [[1]], [1.0])]), setup)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["hf"] == ["kept"] and report["engines"][0]["mode"] == "plain"
    markdown = (tmp_path / "report.md").read_text()
    assert "the draft exported to `runs/x/export`" in markdown and "## Serving engines" in markdown


def test_target_logprob_scores_the_targets_own_choices_above_random_tokens():
    target = load_model("tiny:target")
    ids = [1, 9690, 198, 2683]
    for _ in range(8):  # the target's greedy continuation
        ids.append(target(torch.tensor([ids])).logits[0, -1].argmax().item())
    prompt, greedy = ids[:4], ids[4:]
    scores = token_logprobs(target, prompt, greedy, 0.7)
    first = torch.log_softmax(target(torch.tensor([prompt])).logits[0, -1] / 0.7, -1)[greedy[0]]
    assert scores.shape == (8,) and scores[0].item() == pytest.approx(first.item(), abs=1e-5)
    noise = torch.randint(0, 49152, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    assert scores.mean() > token_logprobs(target, prompt, noise, 0.7).mean() + 0.5  # a near-uniform random model


# --- vLLM -----------------------------------------------------------------------------------------

def test_vllm_speculative_counters_to_acceptance():
    def snapshot(drafts, draft_tokens, accepted):
        counter = lambda name, value: SimpleNamespace(name=name, labels={}, value=value)  # noqa: E731
        return [counter(DRAFTS, drafts), counter(DRAFT_TOKENS, draft_tokens), counter(ACCEPTED, accepted),
                counter("vllm:prompt_tokens", 99),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={}, values=[5, 3])]
    counts = acceptance_counts(spec_counters(snapshot(10, 40, 25)), spec_counters(snapshot(18, 72, 41)))
    assert counts == {"drafts": 8, "draft_tokens": 32, "accepted": 16}
    job = EngineJob(load_config("configs/tiny.yaml", ["eval.temperatures=[0.0]"]), {"a": [[1]], "b": [[2], [3]]},
                    None, Path("."))
    result = {"vllm_version": "0.32.0", "temperatures": {"0.0": [
        {"token_ids": [1, 2, 3, 4], "seconds": 1.0, "accepted": 2, "draft_tokens": 4, "drafts": 1},
        {"token_ids": [5, 6], "seconds": 1.0, "accepted": 0, "draft_tokens": 4, "drafts": 1},
        {"token_ids": [7, 8, 9, 10, 11, 12], "seconds": 1.0, "accepted": 4, "draft_tokens": 8, "drafts": 2}]}}
    by_set = {r.prompt_set: r for r in runs_from_result(result, job, "draft", 4, "float32")}
    assert by_set["a"].tau == pytest.approx(4 / 2) and by_set["a"].alpha == pytest.approx(0.5)
    assert by_set["b"].new_tokens == [2, 6] and by_set["b"].accepted == 4 and by_set["b"].drafted == 12
    assert by_set["b"].tau == pytest.approx(8 / 4)


def test_vllm_serving_result_to_batched_runs():
    job = EngineJob(load_config("configs/tiny.yaml", ["eval.temperatures=[0.0]", "eval.serving_batches=[2]",
                                                      "eval.serving_requests=3"]), {"a": [[1], [2]], "b": [[3]]},
                    None, Path("."))
    assert job.requests(2) == [[1], [2], [1], [2]]  # the first set, repeated to twice the batch at least
    result = {"vllm_version": "0.32.0", "temperatures": {"0.0": [
        {"token_ids": [1], "seconds": 1.0, "accepted": 0, "draft_tokens": 0, "drafts": 0}] * 3},
        "serving": {"0.0/2": {"seconds": 2.0, "accepted": 3, "draft_tokens": 8, "drafts": 2, "requests": [
            {"token_ids": [1, 2], "seconds": 1.5}, {"token_ids": [3], "seconds": 0.5},
            {"token_ids": [4, 5], "seconds": 1.0}, {"token_ids": [6], "seconds": 1.0}]}}}
    (served,) = [r for r in runs_from_result(result, job, "draft", 4, "float32") if r.batch > 1]
    assert (served.prompt_set, served.batch, served.temperature, served.k) == ("a", 2, 0.0, 4)
    assert served.outputs[2] == [4, 5] and served.tok_s == pytest.approx(6 / 2.0)
    assert served.accepted == 3 and served.drafted == 8 and served.tau == pytest.approx(6 / 3)


class FakeEngine:
    """vLLM's LLMEngine as the serving loop sees it: each step gives every request in flight one token; a
    request of prompt [n] finishes after n tokens. Records how many requests were in flight at each step."""

    def __init__(self):
        self.running, self.in_flight = {}, []

    def add_request(self, request_id, prompt, params):
        self.running[request_id] = (prompt, [])

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        self.in_flight.append(len(self.running))
        outputs = []
        for request_id, (prompt, tokens) in list(self.running.items()):
            tokens.append(prompt[0] * 10 + len(tokens))
            finished = len(tokens) == prompt[0]
            if finished:
                del self.running[request_id]
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished,
                                           outputs=[SimpleNamespace(token_ids=list(tokens))]))
        return outputs


def test_vllm_serving_loop_keeps_the_batch_full_and_returns_requests_in_order():
    engine, ticks = FakeEngine(), iter(range(1000))
    served = serve(engine, [[3], [1], [2], [1], [4]], [None] * 5, batch=2, tag="t-", clock=lambda: next(ticks))
    assert [r["token_ids"] for r in served["requests"]] == [[30, 31, 32], [10], [20, 21], [10], [40, 41, 42, 43]]
    assert max(engine.in_flight) == 2 and engine.in_flight[:4] == [2, 2, 2, 2]  # a request joins as one finishes
    assert all(r["seconds"] > 0 for r in served["requests"]) and served["seconds"] > max(
        r["seconds"] for r in served["requests"])


def test_missing_vllm_environment_names_make_setup_vllm(tmp_path):
    with pytest.raises(UserError, match="make setup-vllm"):
        vllm_python(str(tmp_path / "no-venv" / "bin" / "python"))


# --- llama.cpp ------------------------------------------------------------------------------------

def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_llamacpp_plain_output_parsed():
    result = parse_plain(fixture("completion.stdout"), fixture("completion.stderr"), "<|im_end|>")
    expected = json.loads(fixture("expected.json"))
    assert result.prompt_ids == expected["prompt_ids"]
    assert result.new_tokens == expected["plain"]["new_tokens"]
    assert result.seconds == pytest.approx(expected["plain"]["seconds"])
    assert result.text == expected["plain"]["text"]


@pytest.mark.parametrize("tool", ["speculative", "speculative_simple"])
def test_llamacpp_speculative_output_parsed(tool):
    expected = json.loads(fixture("expected.json"))
    result = parse_speculative(fixture(f"{tool}.stdout"), fixture(f"{tool}.stderr"), expected["prompt_text"],
                               "<|im_end|>")
    for name in ("new_tokens", "seconds", "accepted", "drafted"):
        assert getattr(result, name) == pytest.approx(expected[tool][name]), name
    # Greedy: the draft and the n-gram runs say what plain decoding says.
    assert outputs_agree(result.text, expected["plain"]["text"])


def test_llamacpp_output_without_what_we_read_is_a_clear_error():
    with pytest.raises(LlamaCppOutputError, match="n_accept"):
        parse_speculative("\n\nprompt text", "decoded 3 tokens in 0.1 seconds\nn_predict = 3\n", "prompt", "")
    with pytest.raises(LlamaCppOutputError, match="does not start with the prompt"):
        parse_speculative("\n\nsomething else", fixture("speculative.stderr"), "prompt", "")
    with pytest.raises(LlamaCppOutputError, match="listed 1 of its 2"):
        verbose_prompt_ids("number of tokens in prompt = 2\n     1 -> '<|im_start|>'\n")


def test_llamacpp_command_of_each_mode(tmp_path):
    tools = LlamaCppTools(tmp_path, tmp_path / "llama-completion", tmp_path / "llama-speculative-simple")
    job = EngineJob(load_config("configs/tiny.yaml", ["engines.llamacpp_p_min=0.6"]), {}, None, tmp_path)

    def argv(mode):
        return command(tools, mode, 3, Path("t.gguf"), Path("d.gguf"), "hi", job, 0.0, 1, 64)

    def value(args, flag):
        return args[args.index(flag) + 1] if flag in args else None

    for mode, spec_type in (("draft", "draft-simple"), ("eagle3", "draft-eagle3"), ("ngram", "ngram-simple")):
        args = argv(mode)
        assert args[0] == str(tools.speculative_simple) and value(args, "--spec-type") == spec_type
        drafts = mode != "ngram"
        assert value(args, "-md") == ("d.gguf" if drafts else None)
        assert value(args, "--spec-draft-p-min") == ("0.6" if drafts else None)
    assert argv("plain")[0] == str(tools.plain) and "-md" not in argv("plain")


def test_missing_llamacpp_tools_name_make_setup_llamacpp(tmp_path):
    with pytest.raises(UserError, match=r"lacks llama-completion or llama-cli, llama-speculative-simple; run `make setup-llamacpp`"):
        llamacpp_tools(str(tmp_path))


def test_missing_exports_name_make_export(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"engines.export_dir={tmp_path}"])
    for find in (draft_hf, draft_gguf, target_gguf):
        with pytest.raises(MissingExportError, match="run `make export`"):
            find(cfg)


def test_the_export_folder_says_which_draft_the_engines_run(tmp_path):
    def cfg(*args):
        return load_config("configs/tiny.yaml", [f"engines.export_dir={tmp_path}", *args])

    assert draft_kind(cfg()) == "standalone"
    (tmp_path / "eagle3-gguf").mkdir()  # a feature draft's run
    assert draft_kind(cfg()) == "eagle3"
    with pytest.raises(MissingExportError, match=r"eagle3-gguf/draft-q8_0.gguf does not exist"):
        draft_gguf(cfg("engines.llamacpp_draft=q8_0"))
    with pytest.raises(MissingExportError, match=r"eagle3/config.json does not exist"):
        draft_hf(cfg())
    (tmp_path / "gguf").mkdir()
    with pytest.raises(UserError, match="choose one with engines.draft=standalone or engines.draft=eagle3"):
        draft_kind(cfg())
    assert draft_kind(cfg("engines.draft=standalone")) == "standalone"
    job = EngineJob(cfg("engines.ks=[2,3]"), {}, None, tmp_path, draft_mode="eagle3")
    assert job.modes == [("plain", None), ("eagle3", 2), ("ngram", 2), ("eagle3", 3), ("ngram", 3)]
    assert speculative_config("eagle3", 3, tmp_path, 3) == {"method": "eagle3", "model": str(tmp_path),
                                                           "num_speculative_tokens": 3}


def test_a_missing_engine_stops_the_run_before_any_measurement(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, ["--config", "configs/tiny.yaml", f"engines.export_dir={tmp_path}", "engines.run=[hf,vllm]",
                       f"generate.vllm.python={tmp_path}/none/python", f"eval.out_dir={tmp_path}/eval"])
    assert exit_info.value.code == 2
    assert "make setup-vllm" in capsys.readouterr().err
    assert not (tmp_path / "eval").exists()


# --- end to end -----------------------------------------------------------------------------------

def test_hf_engine_end_to_end_on_tiny_models(tmp_path):
    from common.models import load_tokenizer

    hf = tmp_path / "export" / "hf"
    load_model("tiny:draft").save_pretrained(hf)
    load_tokenizer("tiny:draft").save_pretrained(hf)
    out = tmp_path / "eval"
    report = main(["--config", "configs/tiny.yaml", f"engines.export_dir={tmp_path / 'export'}", "engines.run=[hf]",
                   "engines.ks=[2]", "eval.prompts=[gsm8k]", "eval.max_new_tokens=6", f"eval.out_dir={out}"])
    rows = {(r["mode"], r["temperature"]): r for r in report["engines"]}
    assert set(rows) == {(m, t) for m in ("plain", "draft", "ngram") for t in (0.0, 0.7)}
    # HF's assisted generation and prompt lookup are lossless: greedy output is plain greedy output.
    assert rows[("draft", 0.0)]["greedy_identical"] is True and rows[("ngram", 0.0)]["greedy_identical"] is True
    assert all(r["tok_s"] > 0 and r["n_prompts"] == 2 for r in rows.values())
    assert "## Serving engines" in (out / "report.md").read_text()
    assert len((out / "engines" / "outputs.jsonl").read_text().splitlines()) == 6 * 2


def test_hf_runs_plain_and_prompt_lookup_for_a_feature_draft(tmp_path, capsys):
    (tmp_path / "export" / "eagle3").mkdir(parents=True)  # HF cannot run it, so it is never read
    report = main(["--config", "configs/tiny.yaml", f"engines.export_dir={tmp_path / 'export'}", "engines.run=[hf]",
                   "eval.prompts=[gsm8k]", "eval.num_prompts=1", "eval.max_new_tokens=4", "eval.temperatures=[0.0]",
                   f"eval.out_dir={tmp_path / 'eval'}"])
    assert [r["mode"] for r in report["engines"]] == ["plain", "ngram"]
    assert "cannot run an EAGLE-3 draft" in capsys.readouterr().out


@pytest.mark.slow
def test_llamacpp_tools_end_to_end(tmp_path):
    """The built tools (`make setup-llamacpp`; skipped without them) on the embedded target's GGUF, with the
    same file as the draft: flags this build accepts, what it prints, our prompt ids, greedy identity."""
    tools = ROOT / ".llamacpp" / "bin"
    if not (tools / "llama-speculative-simple").is_file():
        pytest.skip("llama.cpp's tools are not built (make setup-llamacpp)")
    from common.models import embedded_gguf

    (tmp_path / "export" / "gguf").mkdir(parents=True)
    (tmp_path / "export" / "gguf" / "draft-f16.gguf").symlink_to(embedded_gguf())
    report = main(["--config", "configs/smollm2.yaml", f"engines.export_dir={tmp_path / 'export'}",
                   "engines.run=[llamacpp]", f"engines.llamacpp_bin={tools}", "engines.llamacpp_target=embedded",
                   "engines.threads=1",  # two threads spin against any other process on a 2-core machine
                   "engines.llamacpp_p_min=0",  # every block drafts k tokens, whatever the target's confidence
                   "eval.prompts=[gsm8k]", "eval.num_prompts=1", "eval.max_new_tokens=8", f"eval.out_dir={tmp_path}"])
    rows = {(r["mode"], r["temperature"]): r for r in report["engines"]}
    assert len(rows) == 6 and all(r["tok_s"] > 0 for r in rows.values())
    assert rows[("draft", 0.0)]["greedy_identical"] is True and rows[("ngram", 0.0)]["greedy_identical"] is True
    assert rows[("draft", 0.0)]["alpha"] == 1.0  # the target drafting for itself
