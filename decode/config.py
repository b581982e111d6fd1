"""Typed configuration for all three stages: YAML mapped onto dataclasses.

One YAML file per experiment drives generate-data, distill and eval-speedup.
Unknown keys, wrong types and impossible values fail here, with a clear
message, before any model is loaded: each section lists its own problems and
`Config.validate` adds the checks that span sections. The machinery lives in
`decode/` because `decode/` must never import `distill/`, and both read the
same file.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from decode.errors import UserError
from decode.sampling import SamplingParams
from decode.tree import TreeShapeError, parse_tree

DTYPE_NAMES = ("auto", "fp32", "bf16")
"""The one spelling of a dtype in every section; 'auto' resolves per machine (decode/precision.py)."""
LOSS_NAMES = ("forward_kl", "reverse_kl", "jsd", "tvd", "neg_log_accept", "lk", "ce")
DATA_SPLITS = ("train", "eval")


class ConfigError(UserError):
    """A configuration problem, reported before any heavy work starts."""


@dataclass
class VllmGenerateConfig:
    """generate.engine=vllm: where vLLM lives and how it spreads the target (passed to vllm.LLM)."""
    python: str = ".venv-vllm/bin/python"
    """The vLLM environment's interpreter (`make setup-vllm`); a relative path is from the working directory."""
    tensor_parallel_size: int = 1
    """GPUs each vLLM instance splits every layer across (one instance per generate-data rank)."""
    pipeline_parallel_size: int = 1
    """Groups of layers each instance spreads over further GPUs (GPUs per instance = tensor x pipeline)."""
    max_model_len: int = 0
    """Context length vLLM reserves per sequence (0 = the target's); prompts that do not fit with
    max_new_tokens are skipped and reported, as generate.max_prompt_tokens does."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each GPU's memory vLLM may use (weights + KV cache)."""
    kv_cache_memory_bytes: int = 0
    """KV cache size in bytes; 0 = vLLM's own sizing on GPUs (from gpu_memory_utilization), 1 GiB on CPU."""
    llm_args: dict[str, int | float | bool | str] = field(default_factory=dict)
    """Further vllm.LLM(...) keyword arguments, e.g. {enforce_eager: true, quantization: fp8}; they are
    part of the resume fingerprint."""


@dataclass
class GenerateConfig:
    out_dir: str = "data/default"
    """Where Parquet shards and manifest.json are written."""
    mode: str = "generate"
    """'generate' samples completions; 'score' runs the target teacher-forced over existing text."""
    sources: list[str] = field(default_factory=lambda: ["embedded"])
    """Prompt sources: 'embedded' (wheel-shipped chat/math/writing prompts), 'persistbench', 'freshqa',
    'writingbench', 'gsm8k', 'humaneval', a local .jsonl/.parquet/.csv file, or 'hf:<dataset name>'.
    Score mode scores their raw text (no chat template)."""
    text_field: str = "prompt"
    """Field holding the prompt text in local files and HF datasets."""
    response_field: str | None = None
    """Score mode: the field holding a response to each prompt (a local file's field or column; 'answer'
    for gsm8k's human-written solutions). Each prompt then gets the chat template and the target is
    teacher-forced over its response + EOS (distill/generation/pairs.py). None: score raw text."""
    system_prompt: str | None = None
    """Optional system message placed before every prompt by the chat template."""
    max_prompts: int = 0
    """Use at most this many prompts after de-duplication (0 = all)."""
    eval_fraction: float = 0.1
    """Fraction of prompts held out for evaluation, chosen by prompt hash."""
    max_new_tokens: int = 96
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    samples_per_prompt: int = 1
    """Completions per prompt, each with its own seed stream."""
    batch_size: int = 128
    """Rows sampled together; large batches keep the CPU's GEMMs efficient (results do not depend on it)."""
    max_batch_tokens: int = 32768
    """Cap on rows x (prompt + new tokens) per batch: bounds the KV cache (SmolLM2 fp32: 46 KB/token)."""
    shard_size: int = 256
    """Rows per Parquet shard; a shard is the unit of resumption."""
    teacher_topk: int = 0
    """Store the target's top-k token ids and logprobs (temperature 1) per completion token; 0 = off."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this (after the chat template) are skipped and reported."""
    dtype: str = "auto"
    """'auto' (bf16 where the device computes it natively: CUDA with bf16, CPUs with avx512_bf16 or AMX;
    else fp32), 'fp32' or 'bf16'. In bf16 the lean runner runs only its GEMMs in bf16 (fp32 weights copy,
    residual stream, softmax): logprobs within KL ~5e-4 of fp32. On an AVX2-only CPU bf16 is emulated,
    5-6x slower than fp32."""
    backend: str = "auto"
    """'auto' uses the lean batched Llama runner when it applies, 'lean' requires it, 'hf' forces HF forwards."""
    engine: str = "auto"
    """'project' (this project's batched runner), 'vllm' (vLLM in its own environment, `make setup-vllm`:
    the same shards and manifest) or 'auto': the engine that started out_dir, else vllm where
    generate.vllm.python imports it and the target is a model folder or hub id, else project."""
    vllm: VllmGenerateConfig = field(default_factory=VllmGenerateConfig)
    stop_after_shards: int = 0
    """Stop each rank after writing this many shards (0 = finish); a rerun resumes. For time-boxed runs and tests."""

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def problems(self) -> list[str]:
        """This section's impossible values, one message each (empty when all is well)."""
        out = [p for name in ("temperature", "top_k", "top_p")
               if (p := _sampling_problem(f"generate.{name}", name, getattr(self, name)))]
        out += _not_one_of("generate.mode", self.mode, ("generate", "score"))
        out += _not_one_of("generate.backend", self.backend, ("auto", "lean", "hf"))
        out += _not_one_of("generate.dtype", self.dtype, DTYPE_NAMES)
        out += _not_one_of("generate.engine", self.engine, ("auto", "project", "vllm"))
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self.vllm, name) <= 0:
                out.append(f"generate.vllm.{name} must be >= 1")
        for name in ("max_model_len", "kv_cache_memory_bytes"):
            if getattr(self.vllm, name) < 0:
                out.append(f"generate.vllm.{name} must be >= 0 (0 = vLLM's default)")
        if not 0 < self.vllm.gpu_memory_utilization <= 1:
            out.append(f"generate.vllm.gpu_memory_utilization: {self.vllm.gpu_memory_utilization} is outside (0, 1]")
        for name in ("batch_size", "shard_size", "samples_per_prompt", "max_new_tokens"):
            if getattr(self, name) <= 0:
                out.append(f"generate.{name} must be >= 1")
        if self.response_field is not None and self.mode != "score":
            out.append("generate.response_field is read in score mode only: set generate.mode=score")
        if self.mode == "score" and self.teacher_topk <= 0:
            out.append("generate.teacher_topk must be >= 1 in score mode (the top-k is what it stores)")
        if not 0 <= self.eval_fraction < 1:
            out.append(f"generate.eval_fraction: {self.eval_fraction} is outside [0, 1)")
        return out


@dataclass
class DistillConfig:
    data_dirs: list[str] = field(default_factory=lambda: ["data/default"])
    """generate-data output folders (generated and/or scored shards) to train on."""
    sources: list[str] = field(default_factory=list)
    """Only rows from these prompt sources, e.g. [gsm8k] for a workload-specialised draft (empty = all)."""
    out_dir: str = "runs/default"
    """Run folder: checkpoints/step-N/, final/, metrics."""
    draft_kind: str = "standalone"
    """'standalone': a small language model of its own (distill/draft.py). 'feature': an EAGLE-3-style
    head reading the target's hidden states (decode/feature_draft.py; needs teacher=online or stored)."""
    init: str = "scratch"
    """'scratch' builds a draft in the target's family; otherwise a pretrained HF model reference."""
    param_ratio: float = 0.02
    """Draft size as a fraction of the target's parameters (embeddings count)."""
    num_layers: int = 2
    """Draft depth; shallow and wide is faster per step."""
    vocab_subset: int = 0
    """Draft output vocabulary: the N most frequent tokens in the data (0 = full vocabulary; a feature
    draft's head rows, 0 = three quarters of what param_ratio leaves after its fixed layers)."""
    spread_other: bool = True
    """With a vocab_subset: train the "other" row as its mass spread evenly over the tokens outside the
    subset, so the draft exports exactly as a full-vocabulary model (hf-full, GGUF) for serving engines,
    and the decoder samples it over the full vocabulary. At the demo's budget it kept held-out acceptance
    (τ(4) 1.378 vs 1.385) and decoded at least as fast. false: the decoder renormalises over the subset
    and the draft exports only lossily. A feature draft's head has no "other" row: ignored there."""
    embed_init: str = "target"
    """'target' initialises draft embeddings from a low-rank projection of the target's (a feature draft:
    its head from the target's head rows of the subset and its final norm); 'random' does not."""
    lora_rank: int = 0
    """With a pretrained init: train LoRA adapters of this rank and merge on export (0 = full fine-tune)."""
    teacher: str = "cached"
    """'cached' uses stored top-k logprobs; 'online' runs the frozen target on every batch; 'stored' (a
    feature draft only) reads the hidden states `make features` stored next to the data and the shards'
    top-k logprobs, so the target runs only in the held-out evaluations (α there stays exact)."""
    loss: dict[str, float] = field(default_factory=lambda: {"forward_kl": 1.0})
    """Loss mix: weights for forward_kl, reverse_kl, jsd, tvd (= 1 − acceptance), neg_log_accept
    (−log acceptance), lk (KL and TVD blended by acceptance, distill/losses.py) and ce."""
    jsd_beta: float = 0.5
    lk_eta: float = 3.0
    """The lk loss weighs forward KL by exp(−lk_eta · α) and TVD by the rest: at 3, KL leads below α ≈ 0.23;
    0 is forward KL alone, large values TVD alone."""
    kd_temperature: float = 1.0
    """Distillation temperature applied to both teacher and student logits."""
    max_seq_len: int = 512
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 200
    lr_schedule_steps: int = 0
    """Step where the cosine schedule reaches its floor (0 = max_steps). Above max_steps, a run
    stops while the learning rate is still high, after the same steps on a fast or a busy machine."""
    max_minutes: float = 0.0
    """Stop training after this many minutes of wall-clock (0 = no limit)."""
    grad_clip: float = 1.0
    eval_every: int = 50
    save_every: int = 50
    eval_samples: int = 64
    early_stop_patience: int = 0
    """Stop after this many evaluations without α improving (0 = never)."""
    max_bad_steps: int = 0
    """Non-finite steps tolerated (skipped) before the run stops."""
    precision: str = "auto"
    """'auto' (bf16 autocast where the device computes bf16 natively: CUDA with bf16, CPUs with
    avx512_bf16 or AMX; else fp32), 'fp32' or 'bf16'. The online teacher and `make features` run the
    target in this dtype; stored features are bf16 on disk whatever it is."""
    deepspeed_config: str | None = None
    """Path to a DeepSpeed JSON config (ZeRO-2/3); None uses plain DDP (FSDP: `accelerate launch
    --config_file configs/fsdp.yaml`)."""
    resume: bool = True
    """Continue from the latest complete checkpoint in out_dir/checkpoints when there is one."""
    export: bool = True
    """At the end, export final/ for serving engines into engines.export_dir (default out_dir/export):
    a feature draft as EAGLE-3, a standalone one that exports exactly as hf-full and gguf
    (distill/export/serving.py); a draft that would not export exactly is skipped with a line saying why."""
    keep_checkpoints: int = 2
    """Keep only the newest N complete checkpoints (0 = keep all)."""
    stop_after: int = 0
    """Save and exit (as on SIGTERM) after this many steps in this invocation: chunked jobs, tests (0 = off)."""
    tau_k: int = 4
    """Draft length k for the τ implied by the held-out α (decode.stats.expected_tau)."""
    feature_layers: list[int] = field(default_factory=list)
    """Feature draft: the target's decoder layers it reads, 0-based (empty = low, middle and high:
    decode.feature_draft.default_target_layers)."""
    feature_intermediate_size: int = 0
    """Feature draft: MLP width (0 = what param_ratio leaves after its fixed layers and head)."""
    ttt_steps: int = 3
    """Feature draft: steps it is unrolled on its own outputs in training (EAGLE-3's training-time test)."""
    ttt_decay: float = 0.8
    """Feature draft: the loss of unrolled step j weighs ttt_decay**j (EAGLE-3's 0.8)."""

    def problems(self) -> list[str]:
        """This section's impossible values, one message each; warns about unusual draft sizes."""
        out = _not_one_of("distill.teacher", self.teacher, ("cached", "online", "stored"))
        out += _not_one_of("distill.precision", self.precision, DTYPE_NAMES)
        out += _not_one_of("distill.embed_init", self.embed_init, ("target", "random"))
        out += _not_one_of("distill.draft_kind", self.draft_kind, ("standalone", "feature"))
        if self.draft_kind == "feature":
            out += self._feature_problems()
        elif self.teacher == "stored":
            out.append("distill.teacher=stored reads the hidden states `make features` stores for a feature draft: "
                       "set distill.draft_kind=feature, or use distill.teacher=cached or online")
        if not 0 < self.param_ratio < 1:
            out.append(f"distill.param_ratio: {self.param_ratio} must be in (0, 1)")
        elif not 0.01 <= self.param_ratio <= 0.03:
            warnings.warn(f"distill.param_ratio={self.param_ratio} is outside the usual 1-3% of the target")
        out += [f"distill.loss: unknown loss {name!r}{_suggest(name, LOSS_NAMES)}"
                for name in self.loss if name not in LOSS_NAMES]
        if any(w < 0 for w in self.loss.values()) or not any(w > 0 for w in self.loss.values()):
            out.append(f"distill.loss={self.loss}: weights must be >= 0 with at least one > 0")
        if self.init == "scratch" and self.lora_rank > 0:
            out.append("distill.lora_rank > 0 needs a pretrained distill.init (LoRA on a random draft is pointless)")
        if self.init != "scratch" and self.vocab_subset:
            out.append("distill.vocab_subset works with init=scratch only (a pretrained head has the full vocabulary)")
        if not 0 < self.jsd_beta < 1:
            out.append(f"distill.jsd_beta={self.jsd_beta} must be in (0, 1)")
        if self.lk_eta < 0:
            out.append(f"distill.lk_eta={self.lk_eta} must be >= 0 (0 = forward KL alone)")
        if self.kd_temperature <= 0:
            out.append(f"distill.kd_temperature={self.kd_temperature} must be > 0")
        for name in ("micro_batch_size", "grad_accum", "max_steps", "max_seq_len", "tau_k"):
            if getattr(self, name) < 1:
                out.append(f"distill.{name} must be >= 1")
        if self.lr_schedule_steps < 0:
            out.append(f"distill.lr_schedule_steps={self.lr_schedule_steps} must be >= 0 (0 = max_steps)")
        if self.deepspeed_config and not Path(self.deepspeed_config).is_file():
            out.append(f"distill.deepspeed_config: {self.deepspeed_config!r} does not exist")
        return out

    def _feature_problems(self) -> list[str]:
        """A feature draft's settings (the layers' upper bound needs the target: distill/training/feature.py)."""
        out = []
        if self.teacher not in ("online", "stored"):
            out.append("distill.draft_kind=feature reads the target's hidden states, which no shard stores: "
                       "set distill.teacher=online, or run `make features` and set distill.teacher=stored")
        if self.init != "scratch":
            out.append("distill.draft_kind=feature trains from scratch: leave distill.init=scratch")
        if self.loss.get("ce"):
            out.append("distill.loss: 'ce' needs a head row for every sampled token, which a feature draft's "
                       "subset head lacks; use forward_kl, reverse_kl, jsd or tvd")
        if any(i < 0 for i in self.feature_layers) or len(set(self.feature_layers)) != len(self.feature_layers):
            out.append(f"distill.feature_layers={self.feature_layers}: list distinct 0-based layer indices")
        if self.feature_intermediate_size < 0 or self.vocab_subset < 0:
            out.append("distill.feature_intermediate_size and distill.vocab_subset must be >= 0 (0 = sized to fit)")
        if self.ttt_steps < 1:
            out.append(f"distill.ttt_steps={self.ttt_steps} must be >= 1")
        if not 0 < self.ttt_decay <= 1:
            out.append(f"distill.ttt_decay={self.ttt_decay} must be in (0, 1]")
        return out


@dataclass
class EvalConfig:
    out_dir: str | None = None
    """Report folder (default: <distill.out_dir>/eval)."""
    prompts: list[str] = field(default_factory=lambda: ["data:eval"])
    """Evaluation prompt sets: 'data:eval' (held-out split of generate.out_dir), a named source (its
    held-out split), or a local file (used whole unless generate.sources trains on it too)."""
    num_prompts: int = 8
    """Prompts per prompt set."""
    max_new_tokens: int = 64
    ks: list[int] = field(default_factory=lambda: [2, 4])
    """Draft lengths to sweep."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    top_k: int = 0
    top_p: float = 1.0
    warmup: int = 1
    """Untimed warm-up generations before measuring."""
    hf_baselines: bool = True
    """Also time HF generate greedy, assisted generation and prompt lookup on the same prompts."""
    r_max_k: int = 8
    """Measure the verification cost r(k) for k = 1..r_max_k."""
    backend: str = "auto"
    """'auto': the lean Llama runner where it applies ('graph', its CUDA-graph replay, on CUDA);
    'lean' or 'graph' require it; 'hf' forces HF forwards with a DynamicCache."""
    dtype: str = "auto"
    """'auto' (bf16 on a GPU with native bf16; fp32 on CPUs, even with AMX: batch-1 decoding feeds its
    GEMMs 1-9 rows, where bf16 ran slower than fp32), 'fp32' or 'bf16'."""
    hf_ks: list[int] = field(default_factory=lambda: [4])
    """k values for the HF assisted-generation and prompt-lookup comparisons."""
    lookup_ngram: int = 0
    """> 0: also run every k with prompt lookup added to the draft (matching the last n..2 tokens,
    decode/lookup.py), reported as 'draft+lookup' rows next to the draft-only ones (0 = off)."""
    trees: list[str] = field(default_factory=list)
    """Draft-tree shapes decoded next to the chains, with each draft kind alone (decode/tree.py):
    '4x2x1x1' (children per depth: the draft's top tokens) or 'dynamic:depth=6,branch=4,nodes=24'
    (EAGLE-2: expand the most probable nodes, keep the most probable `nodes`; nodes=auto: per tree, the
    size and depth the measured cost model predicts fastest). Empty: chains only."""
    serving_batches: list[int] = field(default_factory=list)
    """Batch sizes of the serving table (decode/serving.py): target-only and the standalone draft at each
    k of eval.ks, with continuous batching, on the first prompt set's prompts; [] = none."""
    serving_requests: int = 0
    """Requests decoded per batch size (the prompts repeated): at least twice the batch size."""
    serving_p_min: float = 0.0
    """> 0: also serve each k with p_min: a row stops drafting after a guess its draft gave less than
    this probability (0 = off)."""
    feature_draft: str | None = None
    """A feature draft folder (a `distill.draft_kind=feature` run's final/) measured next to `draft` on the
    same prompts, as 'feature' (and 'feature+lookup') rows; None: none. A `draft` that is itself a
    feature draft gives those rows alone."""

    def sampling(self, temperature: float) -> SamplingParams:
        """The sampling parameters of one swept temperature."""
        return SamplingParams(temperature, self.top_k, self.top_p)

    def problems(self) -> list[str]:
        """This section's impossible values, one message each (empty when all is well)."""
        out = [p for name in ("top_k", "top_p") if (p := _sampling_problem(f"eval.{name}", name, getattr(self, name)))]
        out += [p for i, t in enumerate(self.temperatures)
                if (p := _sampling_problem(f"eval.temperatures[{i}]", "temperature", t))]
        # Empty sweeps would fail only after the models load (max() of nothing, no first prompt).
        for name in ("prompts", "ks", "temperatures") + (("hf_ks",) if self.hf_baselines else ()):
            if not getattr(self, name):
                out.append(f"eval.{name} is empty" + ("; list at least one k or set eval.hf_baselines=false"
                                                     if name == "hf_ks" else ""))
        out += [f"eval.{name}: k={k}; the draft length k must be >= 1"
                for name in ("ks", "hf_ks") for k in getattr(self, name) if k <= 0]
        out += [f"eval.prompts: {source!r} names split {source[5:]!r}; use 'data:eval' or 'data:train'"
                for source in self.prompts if source.startswith("data:") and source[5:] not in DATA_SPLITS]
        for name in ("num_prompts", "max_new_tokens"):
            if getattr(self, name) <= 0:
                out.append(f"eval.{name} must be >= 1")
        if self.lookup_ngram and self.lookup_ngram < 2:
            out.append(f"eval.lookup_ngram: {self.lookup_ngram}; use 0 (off) or an n-gram size >= 2")
        out += _not_one_of("eval.dtype", self.dtype, DTYPE_NAMES)
        out += _not_one_of("eval.backend", self.backend, ("auto", "lean", "graph", "hf"))
        for spec in self.trees:
            try:
                parse_tree(spec)
            except TreeShapeError as error:
                out.append(f"eval.trees: {error}")
        out += [f"eval.serving_batches: batch size {b}; use sizes >= 1" for b in self.serving_batches if b < 1]
        if self.serving_requests < 0:
            out.append("eval.serving_requests must be >= 0 (0: twice each batch size)")
        if not 0 <= self.serving_p_min < 1:
            out.append(f"eval.serving_p_min: {self.serving_p_min}; use a probability in [0, 1) (0 = off)")
        if self.trees and self.backend == "graph":
            out.append("eval.trees: the graph backend (CUDA-graph replay) cannot verify trees; use eval.backend=lean")
        return out


ENGINE_NAMES = ("hf", "vllm", "llamacpp")
GGUF_QUANTS = ("f16", "q8_0")
"""The GGUF files `make export` writes of the draft and the target (distill/export/gguf.py)."""
ENGINE_DRAFTS = ("auto", "standalone", "eagle3")
"""engines.draft: which exported draft the engines run (decode/engines/exports.py)."""


@dataclass
class EnginesConfig:
    """`make eval-engines` (python -m decode.engines): the exported draft inside serving engines, on
    eval-speedup's prompts (eval.prompts, num_prompts, max_new_tokens, temperatures, top_k, top_p)."""
    run: list[str] = field(default_factory=lambda: list(ENGINE_NAMES))
    """Engines to measure: 'hf' (transformers generate), 'vllm', 'llamacpp'."""
    ks: list[int] = field(default_factory=lambda: [4])
    """Draft lengths of the draft and n-gram modes (vLLM num_speculative_tokens, llama.cpp
    --spec-draft-n-max and --spec-ngram-simple-size-m, HF num_assistant_tokens and prompt_lookup_num_tokens)."""
    ngram: int = 3
    """n-gram modes match the last this-many tokens (vLLM prompt_lookup_max, llama.cpp
    --spec-ngram-simple-size-n, HF max_matching_ngram_size)."""
    export_dir: str | None = None
    """`make export`'s folder: hf/, gguf/ or eagle3/, eagle3-gguf/, and target-gguf/ (default:
    <distill.out_dir>/export)."""
    draft: str = "auto"
    """Which exported draft the engines run: 'standalone' (hf/, gguf/: vLLM draft_model, llama.cpp -md,
    HF assistant_model), 'eagle3' (a feature draft's eagle3/, eagle3-gguf/: vLLM and llama.cpp EAGLE-3;
    HF generate has no EAGLE-3, so its draft rows are left out) or 'auto' (the kind the export folder holds)."""
    vllm_dtype: str = "auto"
    """'auto' (the dtype the exported draft was saved in, i.e. trained in), 'fp32' or 'bf16'."""
    vllm_kv_cache_bytes: int = 1 << 30
    """vLLM's KV cache (kv_cache_memory_bytes); its default would claim most of the machine's memory.
    vLLM runs under generate.vllm.python, the environment `make setup-vllm` creates."""
    llamacpp_bin: str = ".llamacpp/bin"
    """The llama.cpp tools `make setup-llamacpp` builds."""
    llamacpp_target: str = "f16"
    """The target llama.cpp runs: 'f16' or 'q8_0' (target-<quant>.gguf from `make export`, written by the
    project's GGUF writer), 'embedded' (the wheel's Q4_1 file) or the path of a .gguf file."""
    llamacpp_draft: str = "f16"
    """Which of the draft's GGUF files llama.cpp runs: 'f16' or 'q8_0'."""
    llamacpp_p_min: float = 0.5
    """llama.cpp --spec-draft-p-min for our draft: a block ends early where the draft's top token has less
    probability, so a target step is not spent verifying guesses the draft doubts. llama.cpp's own default
    0 always drafts k; with the feature draft, 0.5 turned 1.00x into 1.08-1.15x greedy here (README)."""
    threads: int = 0
    """CPU threads of every engine (llama.cpp -t, HF torch threads, vLLM OMP_NUM_THREADS); 0 = every core.
    The same for all, as the engines' own defaults differ (vLLM serves on one thread)."""
    timeout_minutes: float = 30.0
    """Give up on one engine run (a subprocess) after this long."""

    def problems(self) -> list[str]:
        """This section's impossible values, one message each (empty when all is well)."""
        out = [f"engines.run: unknown engine {name!r}{_suggest(name, ENGINE_NAMES)}; known: {', '.join(ENGINE_NAMES)}"
               for name in self.run if name not in ENGINE_NAMES]
        if not self.run:
            out.append("engines.run is empty; list at least one of " + ", ".join(ENGINE_NAMES))
        if not self.ks:
            out.append("engines.ks is empty")
        out += [f"engines.ks: k={k}; the draft length k must be >= 1" for k in self.ks if k <= 0]
        out += _not_one_of("engines.vllm_dtype", self.vllm_dtype, DTYPE_NAMES)
        out += _not_one_of("engines.llamacpp_draft", self.llamacpp_draft, GGUF_QUANTS)
        out += _not_one_of("engines.draft", self.draft, ENGINE_DRAFTS)
        for name in ("ngram", "vllm_kv_cache_bytes"):
            if getattr(self, name) <= 0:
                out.append(f"engines.{name} must be >= 1")
        if not 0 <= self.llamacpp_p_min < 1:
            out.append(f"engines.llamacpp_p_min={self.llamacpp_p_min} must be in [0, 1)")
        if self.threads < 0:
            out.append(f"engines.threads={self.threads} must be >= 0 (0 = every core)")
        if self.timeout_minutes <= 0:
            out.append(f"engines.timeout_minutes={self.timeout_minutes} must be > 0")
        return out


@dataclass
class WandbConfig:
    mode: str = "auto"
    """'auto' (online if logged in, else offline), 'offline', 'online' or 'disabled'."""
    project: str = "spec-distill"


@dataclass
class Config:
    name: str = "default"
    seed: int = 0
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    target: str = "embedded:smollm2-135m-instruct"
    """Target model: 'embedded:smollm2-135m-instruct', 'tiny:target', a local HF directory or a hub id."""
    draft: str = "runs/default/final"
    """Draft model for eval-speedup (same reference kinds as target)."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> None:
        """Check values that are well-typed but impossible, in every section. Raises ConfigError."""
        problems = (self.generate.problems() + self.distill.problems() + self.eval.problems()
                    + self.engines.problems())
        if "data:eval" in self.eval.prompts and self.generate.eval_fraction == 0:
            problems.append("eval.prompts: 'data:eval' is the held-out split of generate.out_dir, which "
                            "generate.eval_fraction=0 leaves empty")
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))

    def check_model_refs(self, *keys: str) -> None:
        """Fail before any heavy work when a model reference cannot load: a missing or incomplete
        local folder, an unknown embedded/tiny name, a hub id while the hub is offline.
        `keys` are the references this stage uses, e.g. 'target' or 'distill.init'."""
        from decode.models import reference_problem  # torch + transformers: only where models are used

        problems = [f"{key}: {problem}" for key in keys
                    if (problem := reference_problem(_value_at(self, key)))]
        if problems:
            raise ConfigError("\n".join(problems))


def _value_at(config: Config, key: str):
    """config.distill.init for 'distill.init'."""
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _sampling_problem(key: str, name: str, value) -> str | None:
    """The sampler's own check of one value, so the config accepts exactly what sampling does."""
    try:
        SamplingParams(**{name: value})
    except (TypeError, ValueError) as e:
        return f"{key}: {e}"
    return None


def _not_one_of(key: str, value: str, choices: tuple[str, ...]) -> list[str]:
    """[] when value is one of choices, else the one problem saying which are allowed."""
    if value in choices:
        return []
    return [f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}{_suggest(value, choices)}"]


def _suggest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(value, annotation, where: str):
    """Check `value` against a type annotation; build nested dataclasses."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return _build(annotation, value, where)
    if origin is list:
        if not isinstance(value, list):
            value = [value] if not isinstance(value, dict) else value
            if isinstance(value, dict):
                raise ConfigError(f"{where}: expected a list, got a mapping")
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        key_t, val_t = typing.get_args(annotation)
        return {_coerce(k, key_t, where): _coerce(v, val_t, f"{where}.{k}") for k, v in value.items()}
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, str, bool) and isinstance(value, annotation) and not (
            annotation is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {getattr(annotation, '__name__', annotation)}, "
                      f"got {type(value).__name__} {value!r}")


def _build(cls, data: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown config key {path!r}{_suggest(key, names)}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
    """['eval.ks=[1,2]', 'seed=3'] -> nested dict, values parsed as YAML scalars/lists."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_reason(e)})") from e
        node[parts[-1]] = _WholeMapping(value) if isinstance(value, dict) else value
    return tree


class _WholeMapping(dict):
    """A mapping given whole as an override's value (`distill.loss={tvd: 1.0}`): it replaces the
    setting instead of merging into it."""


def _merge(base: dict, extra: dict, cls=None) -> dict:
    """base updated by extra, key by key into sections and mappings (`generate.vllm.llm_args.x=1` adds
    one argument), except a mapping-valued setting given whole, which replaces (`distill.loss={tvd: 1.0}`
    is TVD alone, not TVD added to the preset's forward KL). `cls`: the dataclass base and extra fill."""
    hints = typing.get_type_hints(cls) if cls is not None else {}
    out = dict(base)
    for key, value in extra.items():
        section = hints.get(key) if dataclasses.is_dataclass(hints.get(key)) else None
        whole = isinstance(value, _WholeMapping) and section is None
        if isinstance(value, dict) and not whole and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, section)
        else:
            out[key] = value
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `key.sub=value` overrides, type-check and validate it.

    An empty file (or one with only comments) is an error, not a run with every default."""
    data: dict = {}
    if path is not None:
        data = _read_yaml(Path(path))
    data = _merge(data, parse_overrides(overrides or []), Config)
    config = _build(Config, data, "")
    config.validate()
    return config


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML ({_yaml_reason(e)})") from e
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty; see configs/ for examples")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: the top level must be a mapping of keys to values")
    return data


def _yaml_reason(error: yaml.YAMLError) -> str:
    """'<problem> at line L, column C' from a PyYAML error, without its multi-line excerpt."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config next to the artefacts it produced."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
