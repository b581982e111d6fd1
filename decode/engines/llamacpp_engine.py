"""llama.cpp: the tools `make setup-llamacpp` builds, one process per prompt and mode:

  plain  llama-completion (llama-cli in older builds) -m target.gguf
  draft  llama-speculative-simple -m target.gguf -md draft.gguf --spec-type draft-simple --spec-draft-n-max k
         --spec-draft-p-min p (engines.llamacpp_p_min)
  eagle3 the same with -md eagle3-draft.gguf --spec-type draft-eagle3 (a feature draft)
  ngram  llama-speculative-simple -m target.gguf --spec-type ngram-simple (the last n tokens looked up
         in the text so far, the k tokens after the match proposed)

llama-speculative-simple runs the speculative loop llama-server runs (common/speculative.cpp): the draft
proposes greedily, the target's token is sampled at each drafted position and the draft token kept while
they agree, which is lossless at any temperature. (llama-speculative, the older example, verifies by
rejection sampling, but a drafted token cost it ~7 ms here against ~2.5 ms in this loop, same draft.)

The prompt goes in as text with its special tokens (llama.cpp parses them); the plain run lists the
tokens llama.cpp made of it (--verbose-prompt), which must be our prompt's ids. Sampling is the
eval section's (temperature, top-k, top-p) with llama.cpp's other samplers off (min-p 0).
Timing is each tool's own decode timer, which excludes loading the models and the prompt.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from common.errors import UserError
from decode.engines.exports import draft_gguf, target_gguf
from decode.engines.job import EngineFailed, EngineJob
from decode.engines.llamacpp_output import LlamaCppResult, parse_plain, parse_speculative
from decode.engines.rows import EngineRun


PLAIN_TOOLS = ("llama-completion", "llama-cli")
"""Plain decoding: llama-completion where it exists (llama-cli became an interactive chat there)."""



@dataclass
class LlamaCppTools:
    folder: Path
    plain: Path
    speculative_simple: Path


def llamacpp_tools(folder: str) -> LlamaCppTools:
    """The built tools, or a clear error saying how to build them."""
    bin_dir = Path(folder)
    plain = next((bin_dir / name for name in PLAIN_TOOLS if (bin_dir / name).is_file()), None)
    missing = [] if (bin_dir / "llama-speculative-simple").is_file() else ["llama-speculative-simple"]
    if plain is None or missing:
        missing = ([] if plain else [" or ".join(PLAIN_TOOLS)]) + missing
        raise UserError(f"engines.llamacpp_bin: {folder} lacks {', '.join(missing)}; run `make setup-llamacpp` "
                        "to build llama.cpp's tools there")
    return LlamaCppTools(bin_dir, plain, bin_dir / "llama-speculative-simple")


def sampling_args(temperature: float, top_k: int, top_p: float, seed: int) -> list[str]:
    return ["--temp", str(temperature), "--top-k", str(top_k), "--top-p", str(top_p), "--min-p", "0",
            "--seed", str(seed)]


def command(tools: LlamaCppTools, mode: str, k: int | None, target: Path, draft: Path, prompt: str,
            job: EngineJob, temperature: float, seed: int, context: int) -> list[str]:
    ev = job.cfg.eval
    common = ["-m", str(target), "-p", prompt, "-n", str(ev.max_new_tokens), "-c", str(context),
              "-t", str(job.threads), *sampling_args(temperature, ev.top_k, ev.top_p, seed)]
    if mode == "plain":  # -no-cnv: the prompt is already chat-templated
        return [str(tools.plain), *common, "-no-cnv", "--no-display-prompt", "--verbose-prompt"]
    if mode in ("draft", "eagle3"):
        spec_type = "draft-simple" if mode == "draft" else "draft-eagle3"
        return [str(tools.speculative_simple), *common, "-md", str(draft), "--spec-type", spec_type,
                "--spec-draft-n-max", str(k), "--spec-draft-p-min", str(job.cfg.engines.llamacpp_p_min)]
    return [str(tools.speculative_simple), *common, "--spec-type", "ngram-simple",
            "--spec-ngram-simple-size-n", str(job.cfg.engines.ngram), "--spec-ngram-simple-size-m", str(k)]


def run_llamacpp(job: EngineJob) -> list[EngineRun]:
    cfg, ev = job.cfg, job.cfg.eval
    tools = llamacpp_tools(cfg.engines.llamacpp_bin)
    target, draft = target_gguf(cfg), draft_gguf(cfg)
    eos_text = job.tokenizer.eos_token or ""
    context = max(len(ids) for _, ids in job.prompts) + ev.max_new_tokens + max(cfg.engines.ks) + 16
    note = f"target {target.name}, draft {draft.name}"
    runs: dict[tuple, EngineRun] = {}
    for temperature in ev.temperatures:
        for index, (set_name, ids) in enumerate(job.prompts):
            prompt = job.tokenizer.decode(ids)
            # Every mode on this prompt back to back: a machine whose speed drifts (a shared VM) then slows
            # every mode alike instead of whichever ran during the slow minutes.
            for mode, k in job.modes:
                argv = command(tools, mode, k, target, draft, prompt, job, temperature, job.seed(index), context)
                log = job.log_dir / f"llamacpp-{mode}{f'-k{k}' if k else ''}-T{temperature}-{index}.log"
                out = run_tool(argv, log, cfg.engines.timeout_minutes)
                result = (parse_plain(*out, eos_text) if mode == "plain"
                          else parse_speculative(*out, prompt, eos_text))
                if result.prompt_ids is not None and result.prompt_ids != ids:
                    raise EngineFailed(f"llama.cpp tokenized prompt {index} differently from our tokenizer; see {log}")
                add_result(runs.setdefault((mode, k, temperature, set_name), EngineRun(
                    "llamacpp", set_name, mode, k, temperature, [], [], [],
                    accepted=None if mode == "plain" else 0, drafted=None if mode == "plain" else 0, notes=[note])),
                    result)
    return list(runs.values())


def add_result(run: EngineRun, result: LlamaCppResult) -> None:
    run.new_tokens.append(result.new_tokens)
    run.seconds.append(result.seconds)
    run.outputs.append(result.text)
    if run.accepted is not None:
        run.accepted += result.accepted
        run.drafted += result.drafted


def run_tool(argv: list[str], log: Path, timeout_minutes: float) -> tuple[str, str]:
    """(stdout, stderr) of one tool run; both kept in `log`."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout_minutes * 60,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise EngineFailed(f"{Path(argv[0]).name} did not finish within engines.timeout_minutes="
                           f"{timeout_minutes}") from None
    log.write_text(f"$ {' '.join(argv)}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    if proc.returncode != 0:
        raise EngineFailed(f"{Path(argv[0]).name} exited with code {proc.returncode}; see {log}")
    return proc.stdout, proc.stderr
