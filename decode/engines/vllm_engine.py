"""vLLM: each mode (plain, the exported draft as `draft_model` or a feature draft as `eagle3`, vLLM's
`ngram` prompt lookup) starts its own engine in a subprocess of the vLLM environment
(decode/engines/vllm_worker.py), which decodes every prompt at every temperature; this side writes the
job, reads the result, and keeps the log.

vLLM lives in its own environment (`make setup-vllm`), so `make test` and the rest of the project
never install it. On CPU it wants Intel OpenMP preloaded (without it n-gram speculation ran ~7x
slower) and, on a shared machine, no thread pinning. On CPU the `eagle3` mode runs without
torch.compile (enforce_eager): compiling the EAGLE-3 drafter once killed the worker on a busy machine
(vLLM 0.32, a RecursionError in CPUDNNLGEMMHandler); on a quiet one compiled and eager decoded at
about the same speed (27.2 vs 26.8 tok/s greedy, two runs minutes apart, identical outputs); its rows say so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import torch

from common.errors import UserError
from common.models import EMBEDDED, embedded_dir
from decode.engines.exports import draft_hf
from decode.engines.job import EngineFailed, EngineJob
from decode.engines.rows import EngineRun


WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}



def vllm_python(path: str) -> Path:
    """The vLLM environment's interpreter (generate.vllm.python: the one generate-data uses too), or a
    clear error saying how to create it."""
    python = Path(path)
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise UserError(f"generate.vllm.python: {path} does not exist; run `make setup-vllm` to create the vLLM "
                        "environment, or set generate.vllm.python to a Python that has vllm installed")
    return python


def worker_env(python: Path, threads: int) -> dict[str, str]:
    """The environment the worker runs in: Intel OpenMP preloaded when the vLLM environment has it,
    threads left unpinned (other processes share the cores) and set to `threads` (vLLM would use one)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # <env>/bin/python -> <env>/lib
    if iomp.is_file():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    return env


def target_folder(ref: str) -> str:
    """The target as vLLM loads it: the embedded one's converted folder, a local folder or a hub id."""
    if ref == EMBEDDED:
        return str(embedded_dir())
    if ref.startswith("tiny:"):
        raise UserError(f"target {ref!r} exists only in memory; vLLM and llama.cpp need a target saved as files")
    return ref


def draft_dtype(draft_dir: Path, choice: str) -> str:
    """vLLM's dtype: the one chosen, or with 'auto' the one the exported draft was saved (trained) in."""
    if choice != "auto":
        return VLLM_DTYPES[choice]
    config = json.loads((draft_dir / "config.json").read_text())
    return config.get("dtype") or config.get("torch_dtype") or "float32"


def speculative_config(mode: str, k: int | None, draft_dir: Path, ngram: int) -> dict | None:
    if mode in ("draft", "eagle3"):
        method = "draft_model" if mode == "draft" else "eagle3"
        return {"method": method, "model": str(draft_dir), "num_speculative_tokens": k}
    if mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": ngram}
    return None


def run_vllm(job: EngineJob) -> list[EngineRun]:
    cfg, ev = job.cfg, job.cfg.eval
    python = vllm_python(cfg.generate.vllm.python)
    draft_dir = draft_hf(cfg)
    dtype = draft_dtype(draft_dir, cfg.engines.vllm_dtype)
    prompts = [ids for _, ids in job.prompts]
    base = {"model": target_folder(cfg.target), "dtype": dtype, "seed": cfg.seed, "prompts": prompts,
            "seeds": [job.seed(i) for i in range(len(prompts))],
            "max_model_len": max(map(len, prompts)) + ev.max_new_tokens + max(cfg.engines.ks) + 16,
            "kv_cache_memory_bytes": cfg.engines.vllm_kv_cache_bytes, "max_new_tokens": ev.max_new_tokens,
            "temperatures": ev.temperatures, "top_k": ev.top_k, "top_p": ev.top_p,
            "serving": [{"batch": batch, "prompts": job.requests(batch),
                         "seeds": [job.seed(i) for i in range(len(job.requests(batch)))]}
                        for batch in ev.serving_batches if batch > 1]}
    runs = []
    for mode, k in job.modes:
        name = f"vllm-{mode}" + (f"-k{k}" if k else "")
        job_file = job.log_dir / f"{name}.job.json"
        eager = mode == "eagle3" and not torch.cuda.is_available()
        job_file.write_text(json.dumps({**base, "speculative_config": speculative_config(mode, k, draft_dir,
                                                                                          cfg.engines.ngram),
                                        "enforce_eager": eager}))
        result = run_worker(python, job_file, job.log_dir / f"{name}.result.json", job.log_dir / f"{name}.log",
                            job.threads, cfg.engines.timeout_minutes)
        runs += runs_from_result(result, job, mode, k, dtype + (", enforce_eager" if eager else ""))
    return runs


def run_worker(python: Path, job_file: Path, result_file: Path, log: Path, threads: int,
               timeout_minutes: float) -> dict:
    result_file.unlink(missing_ok=True)
    # Its own process group: vLLM's engine-core process goes too when the worker is stopped.
    with open(log, "w") as out, subprocess.Popen([str(python), str(WORKER), str(job_file), str(result_file)],
                                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                                 env=worker_env(python, threads)) as proc:
        try:
            proc.wait(timeout=timeout_minutes * 60)
        except BaseException as stopped:  # the timeout, Ctrl-C: vLLM's processes must not outlive this run
            os.killpg(proc.pid, signal.SIGKILL)
            if isinstance(stopped, subprocess.TimeoutExpired):
                raise EngineFailed(f"vLLM did not finish within engines.timeout_minutes={timeout_minutes}; "
                                   f"see {log}") from None
            raise
    if proc.returncode != 0 or not result_file.is_file():
        raise EngineFailed(f"vLLM exited with code {proc.returncode}; see {log} ({last_line(log)})")
    return json.loads(result_file.read_text())


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "empty log"


def runs_from_result(result: dict, job: EngineJob, mode: str, k: int | None, settings: str) -> list[EngineRun]:
    """The worker's per-prompt results as one EngineRun per (temperature, prompt set), then its serving
    results as one per (temperature, batch size); `settings` (dtype, eager) goes into their notes after
    vLLM's version."""
    notes = [f"vLLM {result['vllm_version']}, {settings}"]
    speculative = mode != "plain"
    runs = []
    for temperature in job.cfg.eval.temperatures:
        per_set: dict[str, EngineRun] = {}
        for (set_name, _), out in zip(job.prompts, result["temperatures"][str(temperature)], strict=True):
            run = per_set.setdefault(set_name, EngineRun(
                "vllm", set_name, mode, k, temperature, [], [], [], accepted=0 if speculative else None,
                drafted=0 if speculative else None, notes=notes))
            run.new_tokens.append(len(out["token_ids"]))
            run.seconds.append(out["seconds"])
            run.outputs.append(out["token_ids"])
            if speculative:
                run.accepted += out["accepted"]
                run.drafted += out["draft_tokens"]
        runs += per_set.values()
    for key, served in result.get("serving", {}).items():
        temperature, batch = key.split("/")
        requests = served["requests"]
        runs.append(EngineRun("vllm", job.serving_set, mode, k, float(temperature),
                              [len(r["token_ids"]) for r in requests], [r["seconds"] for r in requests],
                              [r["token_ids"] for r in requests], accepted=served["accepted"] if speculative else None,
                              drafted=served["draft_tokens"] if speculative else None, notes=notes,
                              batch=int(batch), wall_s=served["seconds"]))
    return runs
