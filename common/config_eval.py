"""The eval-speedup, engines and W&B sections of the configuration (common/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config_checks import (DATA_SPLITS, DTYPE_NAMES, ENGINE_DRAFTS, ENGINE_NAMES, GGUF_QUANTS, not_one_of,
                                  sampling_problem, suggest)
from common.sampling import SamplingParams
from decode.tree import TreeShapeError, parse_tree


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
    """Untimed warm-up generations before measuring (besides: each prompt is prefilled once, untimed, on every
    runner before its timed runs, and on CUDA every graph the runs replay is captured first)."""
    hf_baselines: bool = True
    """Also time HF generate greedy, assisted generation and prompt lookup on the same prompts."""
    r_max_k: int = 8
    """Measure the verification cost r(k) for k = 1..r_max_k."""
    backend: str = "auto"
    """'auto': the lean Llama runner where it applies ('graph', its CUDA-graph replay, on CUDA);
    'lean' or 'graph' require it; 'hf' forces HF forwards with a DynamicCache."""
    dtype: str = "auto"
    """'auto' (bf16 on a GPU with native bf16 and on a CPU with AMX, where oneDNN's packed bf16 GEMMs beat
    fp32 at 1-65 rows; fp32 on other CPUs), 'fp32' or 'bf16'. In bf16 on a CPU each row of a forward, batch 1
    or the serving table's batches, gets the bits a one-token batch-1 forward gives it, so speculative output
    equals bf16 target-only token for token. Drafts (standalone and feature) decode in fp32 on any CPU
    (faster there), in this dtype on a GPU."""
    hf_prompts: int = 0
    """HF baselines on the first this-many prompts of each set (0: all of them), compared with our runs
    on the same prompts: HF generate is the slowest part of eval-speedup on a CPU."""
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
    """Batch sizes of the serving table (decode/serving.py): target-only and each draft measured (standalone,
    standalone behind prompt lookup when lookup_ngram > 0, feature) at each k of eval.ks, with continuous
    batching, on the first prompt set's prompts; [] = none. `make eval-engines` serves the same requests in
    vLLM at each batch size > 1."""
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
        out = [p for name in ("top_k", "top_p") if (p := sampling_problem(f"eval.{name}", name, getattr(self, name)))]
        out += [p for i, t in enumerate(self.temperatures)
                if (p := sampling_problem(f"eval.temperatures[{i}]", "temperature", t))]
        # Empty sweeps would fail only after the models load (max() of nothing, no first prompt).
        for name in ("prompts", "ks", "temperatures") + (("hf_ks",) if self.hf_baselines else ()):
            if not getattr(self, name):
                out.append(f"eval.{name} is empty" + ("; list at least one k or set eval.hf_baselines=false"
                                                     if name == "hf_ks" else ""))
        out += [f"eval.{name}: k={k}; the draft length k must be >= 1"
                for name in ("ks", "hf_ks") for k in getattr(self, name) if k <= 0]
        out += [f"eval.prompts: {source!r} names split {source[5:]!r}; use 'data:eval' or 'data:train'"
                for source in self.prompts if source.startswith("data:") and source[5:] not in DATA_SPLITS]
        if self.hf_prompts < 0:
            out.append("eval.hf_prompts must be >= 0 (0: every prompt)")
        for name in ("num_prompts", "max_new_tokens"):
            if getattr(self, name) <= 0:
                out.append(f"eval.{name} must be >= 1")
        if self.lookup_ngram and self.lookup_ngram < 2:
            out.append(f"eval.lookup_ngram: {self.lookup_ngram}; use 0 (off) or an n-gram size >= 2")
        out += not_one_of("eval.dtype", self.dtype, DTYPE_NAMES)
        out += not_one_of("eval.backend", self.backend, ("auto", "lean", "graph", "hf"))
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
        out = [f"engines.run: unknown engine {name!r}{suggest(name, ENGINE_NAMES)}; known: {', '.join(ENGINE_NAMES)}"
               for name in self.run if name not in ENGINE_NAMES]
        if not self.run:
            out.append("engines.run is empty; list at least one of " + ", ".join(ENGINE_NAMES))
        if not self.ks:
            out.append("engines.ks is empty")
        out += [f"engines.ks: k={k}; the draft length k must be >= 1" for k in self.ks if k <= 0]
        out += not_one_of("engines.vllm_dtype", self.vllm_dtype, DTYPE_NAMES)
        out += not_one_of("engines.llamacpp_draft", self.llamacpp_draft, GGUF_QUANTS)
        out += not_one_of("engines.draft", self.draft, ENGINE_DRAFTS)
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
