"""`make eval-engines`: the exported draft inside serving engines, on eval-speedup's prompts.

    python -m decode.engines --config configs/smollm2.yaml [key.sub=value ...]

For every engine in engines.run: plain decoding, our exported draft and the engine's own n-gram mode
at each k in engines.ks, at every eval temperature, one prompt at a time; in vLLM also at each batch size
> 1 of eval.serving_batches, serving eval.serving_requests requests with continuous batching (the
requests our own serving table decodes, decode/serving.py). The rows go into
<eval.out_dir>/report.json (`engines`, added to an existing eval-speedup report) and report.md
("Serving engines"); each engine's logs and every output into <eval.out_dir>/engines/.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from transformers import AutoConfig

from common.cli import cli_config, run_cli
from common.config import Config, config_to_dict
from common.models import load_tokenizer, tiny_model
from common.provenance import git_revision
from decode.eval_speedup import eval_prompts
from decode.engines.exports import draft_gguf, draft_hf, draft_kind, export_dir, target_gguf
from decode.engines.hf_engine import run_hf
from decode.engines.job import EngineJob
from decode.engines.llamacpp_engine import llamacpp_tools, run_llamacpp
from decode.engines.rows import EngineRun, engine_rows
from decode.engines.target_logprob import score_runs
from decode.engines.vllm_engine import run_vllm, target_folder, vllm_python
from decode.report import plot_engine_serving, write_engines_markdown, write_markdown


RUNNERS = {"hf": run_hf, "vllm": run_vllm, "llamacpp": run_llamacpp}


def check_ready(cfg: Config) -> dict[str, str]:
    """Refuse before any measurement when an engine's environment, tools or exported files are missing;
    returns the files the engines will read, by what they are."""
    engines, eagle3 = cfg.engines.run, draft_kind(cfg) == "eagle3"
    files = {}
    if "vllm" in engines or ("hf" in engines and not eagle3):
        files["draft (EAGLE-3 folder)" if eagle3 else "draft (HF folder)"] = str(draft_hf(cfg))
    if "vllm" in engines:
        files["vLLM interpreter"] = str(vllm_python(cfg.generate.vllm.python))
        target_folder(cfg.target)  # refuses a target that exists only in memory (tiny:)
    if "llamacpp" in engines:
        files["llama.cpp tools"] = str(llamacpp_tools(cfg.engines.llamacpp_bin).folder)
        files["llama.cpp target"] = str(target_gguf(cfg))
        files["llama.cpp draft"] = str(draft_gguf(cfg))
    return files


def context_length(ref: str) -> int:
    if ref.startswith("tiny:"):
        return tiny_model(ref[5:]).config.max_position_embeddings
    return AutoConfig.from_pretrained(target_folder(ref)).max_position_embeddings


def main(argv: list[str] | None = None) -> dict:
    cfg = cli_config(argv, "Measure the exported draft inside serving engines (HF, vLLM, llama.cpp).")
    cfg.check_model_refs("target")
    files = check_ready(cfg)
    tokenizer = load_tokenizer(cfg.target)
    prompt_sets = eval_prompts(cfg, tokenizer, context_length(cfg.target))
    out_dir = Path(cfg.eval.out_dir or Path(cfg.distill.out_dir) / "eval")
    log_dir = out_dir / "engines"
    log_dir.mkdir(parents=True, exist_ok=True)
    job = EngineJob(cfg, {name: [list(p.token_ids) for p in prompts] for name, prompts in prompt_sets.items()},
                    tokenizer, log_dir, draft_mode="eagle3" if draft_kind(cfg) == "eagle3" else "draft")
    runs: list[EngineRun] = []
    for engine in cfg.engines.run:
        batches = [b for b in cfg.eval.serving_batches if b > 1]
        print(f"{engine}: {len(job.modes)} modes x {len(cfg.eval.temperatures)} temperatures x "
              f"{len(job.prompts)} prompts" + (f", and batches {batches}" if engine == "vllm" and batches else
                                               " (batch 1 only)" if batches else ""), flush=True)
        runs += RUNNERS[engine](job)
    score_runs(runs, job)
    write_outputs(runs, job, log_dir / "outputs.jsonl")
    setup = {"command": " ".join(["python -m decode.engines"] + (argv if argv is not None else sys.argv[1:])),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "threads": job.threads, "export_dir": str(export_dir(cfg)), "files": files,
             "prompt_sets": {name: [p.prompt_id for p in prompts] for name, prompts in prompt_sets.items()}}
    report = add_to_report(out_dir, cfg, engine_rows(runs), setup)
    print_rows(report["engines"], out_dir)
    return report


def add_to_report(out_dir: Path, cfg: Config, rows: list[dict], setup: dict) -> dict:
    """The rows into report.json: added to the eval-speedup report already there, else a report of their own."""
    path = out_dir / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else {
        "config": config_to_dict(cfg), "git_sha": git_revision() or "unknown"}
    report["engines"], report["engines_setup"] = rows, setup
    path.write_text(json.dumps(report, indent=2, default=str))
    if any(row["batch"] > 1 for row in rows):
        plot_engine_serving(rows, out_dir / "engines_serving.png")
    if "results" in report:
        write_markdown(report, out_dir / "report.md")
    else:
        write_engines_markdown(report, out_dir / "report.md")
    return report


def write_outputs(runs: list[EngineRun], job: EngineJob, path: Path) -> None:
    """Every prompt's output in every run, as text: what the greedy check compared, for reading."""
    with open(path, "w") as f:
        for run in runs:
            for index, output in enumerate(run.outputs):
                text = output if isinstance(output, str) else job.tokenizer.decode(output)
                f.write(json.dumps({"engine": run.engine, "prompt_set": run.prompt_set, "prompt_index": index,
                                    "mode": run.mode, "k": run.k, "temperature": run.temperature,
                                    "batch": run.batch, "text": text}) + "\n")


def print_rows(rows: list[dict], out_dir: Path) -> None:
    print(f"\n{'engine':<10}{'prompts':<14}{'T':>5}{'batch':>6}{'mode':>7}{'k':>3}{'tok/s':>9}{'speedup':>9}{'tau':>7}"
          f"{'log p':>7}  greedy-identical")
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] and r["mode"] != "plain" else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        logprob = f"{r['target_logprob']:.2f}" if r["target_logprob"] is not None else "-"
        same = "-" if r["greedy_identical"] is None else str(r["greedy_identical"])
        print(f"{r['engine']:<10}{r['prompt_set'][:13]:<14}{r['temperature']:>5}{r['batch']:>6}{r['mode']:>7}"
              f"{r['k'] or '-':>3}"
              f"{r['tok_s']:>9.1f}{speedup:>9}{tau:>7}{logprob:>7}  {same}")
    print(f"\nreport: {out_dir / 'report.md'}")


if __name__ == "__main__":
    run_cli(main)
