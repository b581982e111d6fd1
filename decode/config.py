"""Typed configuration for all three stages: YAML mapped onto dataclasses.

One YAML file per experiment drives generate-data, distill and eval-speedup.
Unknown keys, wrong types and impossible values fail here, with a clear
message, before any model is loaded. The machinery lives in `decode/` because
`decode/` must never import `distill/`, and both read the same file.
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


class ConfigError(ValueError):
    """A configuration problem, reported before any heavy work starts."""


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables."""


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
    dtype: str = "float32"
    """'float32' or 'bfloat16'. The lean runner then runs only its GEMMs in bf16 (fp32 weights copy, residual
    stream, softmax): ~2x faster batches on CPUs with avx512_bf16, logprobs within KL ~5e-4 of fp32."""
    backend: str = "auto"
    """'auto' uses the lean batched Llama runner when it applies, 'lean' requires it, 'hf' forces HF forwards."""
    stop_after_shards: int = 0
    """Stop each rank after writing this many shards (0 = finish); a rerun resumes. For time-boxed runs and tests."""


@dataclass
class DistillConfig:
    data_dirs: list[str] = field(default_factory=lambda: ["data/default"])
    """generate-data output folders (generated and/or scored shards) to train on."""
    sources: list[str] = field(default_factory=list)
    """Only rows from these prompt sources, e.g. [gsm8k] for a workload-specialised draft (empty = all)."""
    out_dir: str = "runs/default"
    """Run folder: checkpoints/step-N/, final/, metrics."""
    init: str = "scratch"
    """'scratch' builds a draft in the target's family; otherwise a pretrained HF model reference."""
    param_ratio: float = 0.02
    """Draft size as a fraction of the target's parameters (embeddings count)."""
    num_layers: int = 2
    """Draft depth; shallow and wide is faster per step."""
    vocab_subset: int = 0
    """Draft output vocabulary: the N most frequent tokens in the data (0 = full vocabulary)."""
    embed_init: str = "target"
    """'target' initialises draft embeddings from a low-rank projection of the target's; 'random' does not."""
    lora_rank: int = 0
    """With a pretrained init: train LoRA adapters of this rank and merge on export (0 = full fine-tune)."""
    teacher: str = "cached"
    """'cached' uses stored top-k logprobs; 'online' runs the frozen target on every batch."""
    loss: dict[str, float] = field(default_factory=lambda: {"forward_kl": 1.0})
    """Loss mix: weights for forward_kl, reverse_kl, jsd, tvd, ce."""
    jsd_beta: float = 0.5
    kd_temperature: float = 1.0
    """Distillation temperature applied to both teacher and student logits."""
    max_seq_len: int = 512
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 200
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
    """'auto' (bf16 on GPU, fp32 on CPU), 'fp32' or 'bf16'."""
    deepspeed_config: str | None = None
    """Path to a DeepSpeed JSON config (ZeRO-2/3); None uses plain DDP (FSDP: `accelerate launch
    --config_file configs/fsdp.yaml`)."""
    resume: bool = True
    """Continue from the latest complete checkpoint in out_dir/checkpoints when there is one."""
    keep_checkpoints: int = 2
    """Keep only the newest N complete checkpoints (0 = keep all)."""
    stop_after: int = 0
    """Save and exit (as on SIGTERM) after this many steps in this invocation: chunked jobs, tests (0 = off)."""
    tau_k: int = 4
    """Draft length k for the τ implied by the held-out α (decode.stats.expected_tau)."""


@dataclass
class EvalConfig:
    out_dir: str | None = None
    """Report folder (default: <distill.out_dir>/eval)."""
    prompts: list[str] = field(default_factory=lambda: ["data:eval"])
    """Evaluation prompt sets: 'data:eval' (held-out split of generate.out_dir), or any generate source."""
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
    """'auto' (bf16 on GPU, fp32 on CPU), 'fp32' or 'bf16'."""
    hf_ks: list[int] = field(default_factory=lambda: [4])
    """k values for the HF assisted-generation and prompt-lookup comparisons."""
    lookup_ngram: int = 0
    """> 0: also run every k with prompt lookup added to the draft (matching the last n..2 tokens,
    decode/lookup.py), reported as 'draft+lookup' rows next to the draft-only ones (0 = off)."""


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
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> None:
        """Check values that are well-typed but impossible. Raises ConfigError."""
        problems = []
        for where, s in (("generate", self.generate), ("eval", self.eval)):
            problems += _sampling_problems(where, s.temperature if hasattr(s, "temperature") else 0.0,
                                           s.top_k, s.top_p)
        for t in self.eval.temperatures:
            if t < 0:
                problems.append(f"eval.temperatures: {t} < 0; temperature must be >= 0")
        for k in self.eval.ks + self.eval.hf_ks:
            if k <= 0:
                problems.append(f"eval.ks: k={k}; the draft length k must be >= 1")
        if self.generate.mode not in ("generate", "score"):
            problems.append(f"generate.mode: {self.generate.mode!r} is not 'generate' or 'score'")
        if self.distill.teacher not in ("cached", "online"):
            problems.append(f"distill.teacher: {self.distill.teacher!r} is not 'cached' or 'online'")
        if not 0 < self.distill.param_ratio < 1:
            problems.append(f"distill.param_ratio: {self.distill.param_ratio} must be in (0, 1)")
        elif not 0.01 <= self.distill.param_ratio <= 0.03:
            warnings.warn(f"distill.param_ratio={self.distill.param_ratio} is outside the usual 1-3% of the target")
        known_losses = {"forward_kl", "reverse_kl", "jsd", "tvd", "ce"}
        for name in self.distill.loss:
            if name not in known_losses:
                problems.append(f"distill.loss: unknown loss {name!r}{_suggest(name, known_losses)}")
        for name in ("batch_size", "shard_size", "samples_per_prompt", "max_new_tokens"):
            if getattr(self.generate, name) <= 0:
                problems.append(f"generate.{name} must be >= 1")
        if self.eval.lookup_ngram and self.eval.lookup_ngram < 2:
            problems.append(f"eval.lookup_ngram: {self.eval.lookup_ngram}; use 0 (off) or an n-gram size >= 2")
        if self.eval.dtype not in ("auto", "fp32", "bf16"):
            problems.append(f"eval.dtype: {self.eval.dtype!r} is not 'auto', 'fp32' or 'bf16'")
        if self.eval.backend not in ("auto", "lean", "graph", "hf"):
            problems.append(f"eval.backend: {self.eval.backend!r} is not 'auto', 'lean', 'graph' or 'hf'")
        if self.eval.max_new_tokens <= 0:
            problems.append("eval.max_new_tokens must be >= 1")
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))

    def check_model_refs(self, *which: str) -> None:
        """Fail early when a model reference names a local path that does not exist."""
        for attr in which:
            ref = getattr(self, attr)
            if looks_like_local_path(ref) and not Path(ref).expanduser().exists():
                raise ConfigError(f"{attr}: model path {ref!r} does not exist")


def _sampling_problems(where: str, temperature: float, top_k: int, top_p: float) -> list[str]:
    out = []
    if temperature < 0:
        out.append(f"{where}.temperature: {temperature} < 0; temperature must be >= 0")
    if top_k < 0:
        out.append(f"{where}.top_k: {top_k} < 0; use 0 to disable top-k")
    if not 0 < top_p <= 1:
        out.append(f"{where}.top_p: {top_p} is outside (0, 1]")
    return out


def looks_like_local_path(ref: str) -> bool:
    """A hub id is 'org/name'; anything with a scheme prefix is special; the rest is a path."""
    if ref.startswith(("embedded:", "tiny:")):
        return False
    if ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        return True
    return Path(ref).exists()


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
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `key.sub=value` overrides, type-check and validate it."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    data = _merge(data, parse_overrides(overrides or []))
    config = _build(Config, data, "")
    config.validate()
    return config


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config next to the artefacts it produced."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def cli_config(argv: list[str] | None, description: str) -> Config:
    """Shared command line: `--config path.yaml key.sub=value ...`; `--help` lists every key."""
    import argparse

    parser = argparse.ArgumentParser(description=description, epilog=_help_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. eval.ks=[2,4]")
    args = parser.parse_args(argv)
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        parser.exit(2, f"error: {e}\n")


def _help_epilog() -> str:
    lines = ["config keys (defaults):"]
    for section in (None, "generate", "distill", "eval", "wandb"):
        cls = Config if section is None else typing.get_type_hints(Config)[section]
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or f.name in ("generate", "distill", "eval", "wandb"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            key = f.name if section is None else f"{section}.{f.name}"
            lines.append(f"  {key} = {default!r}")
    return "\n".join(lines)
