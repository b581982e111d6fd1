"""GGUF files of the full-vocabulary draft (`--format gguf`), for llama.cpp's `-md`.

llama.cpp takes a draft only when its vocabulary matches the target's: the same vocabulary type,
BOS/EOS ids and add-BOS/EOS flags, sizes within 128 and the same token text from id 5 on. The
tokenizer metadata (every `tokenizer.*` key) is therefore copied from a GGUF of the target: the
embedded target's own (common.models.embedded_gguf, also for the tiny test models, which share its
tokenizer), or the file the user serves the target from (target_gguf). The weights are the
hf-full export's (distill/export/hf_full.py), written under llama.cpp's Llama tensor names with
the q/k rows permuted as llama.cpp's convert_hf_to_gguf.py does (its rotary embedding pairs
dimensions i and i + 1 of a head, HF's i and i + D/2).

Two files: f16 (norms in f32) and q8_0 (matrices whose rows are not a multiple of the 32-value
block stay f16, as in convert_hf_to_gguf.py).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from common.errors import UserError
from distill.export.gguf_metadata import MetadataField, read_metadata


# File name suffix -> (GGUF file type, the type of 2-D weight matrices).
QUANTS = {
    "f16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
}
TOKENIZER_PREFIX = "tokenizer."


class GGUFExportError(UserError):
    """A draft or target the GGUF export cannot describe for llama.cpp."""


def tokenizer_fields(target_gguf: Path) -> list[MetadataField]:
    """Every `tokenizer.*` field of the target's GGUF, in file order."""
    return [field for name, field in read_metadata(target_gguf).items() if name.startswith(TOKENIZER_PREFIX)]


def write_gguf_files(model, fields: list, folder: Path, name: str) -> list[Path]:
    """`model` (a full-vocabulary Llama) as folder/<name>-<quant>.gguf for every quant in QUANTS."""
    _check_llama(model, fields)
    return write_quants(folder, name, "llama", model.config, fields, llama_tensors(model))


def write_quants(folder: Path, name: str, arch: str, config, fields: list, tensors: dict[str, np.ndarray],
                 add_arch_metadata=None) -> list[Path]:
    """folder/<name>-<quant>.gguf for every quant in QUANTS: the model metadata of `config` (HF names),
    `add_arch_metadata(writer)` where the architecture has more, the copied tokenizer fields, `tensors`."""
    paths = []
    for quant, (file_type, matrix_type) in QUANTS.items():
        path = folder / f"{name}-{quant}.gguf"
        writer = gguf.GGUFWriter(path, arch)
        add_model_metadata(writer, config, name, file_type)
        if add_arch_metadata is not None:
            add_arch_metadata(writer)
        for field in fields:
            _copy_field(writer, field)
        for tensor_name, value in tensors.items():
            _add_tensor(writer, tensor_name, value, matrix_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths


def _check_llama(model, fields: list) -> None:
    config = model.config
    if config.model_type != "llama":
        raise GGUFExportError(f"the GGUF export writes Llama drafts; this draft is a {config.model_type!r}")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise GGUFExportError(f"the GGUF export writes plain rotary embeddings; this draft uses {rope_type!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise GGUFExportError("the GGUF export writes bias-free Llama layers; this draft has biases")
    tokens = next((f for f in fields if f.name == "tokenizer.ggml.tokens"), None)
    rows = model.get_input_embeddings().weight.shape[0]
    if tokens is None or len(tokens.value) != rows:
        found = "no token list" if tokens is None else f"{len(tokens.value)} tokens"
        raise GGUFExportError(f"the target's GGUF tokenizer has {found}, the draft {rows} embedding rows: "
                              "llama.cpp needs one row per token")


def add_model_metadata(writer, config, name: str, file_type) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _copy_field(writer, field) -> None:
    """One metadata field as the target's file has it (value type, and element type for arrays)."""
    writer.add_key_value(field.name, field.value, field.type, sub_type=field.item_type)


def llama_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> fp32 array; q/k permuted for llama.cpp's rotary layout. A tied head
    is left out (llama.cpp then reads token_embd)."""
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    out = {}
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue
        value = value.detach().float()
        if hf_name.endswith("q_proj.weight"):
            value = permute_for_rope(value, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            value = permute_for_rope(value, config.num_key_value_heads)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
        if gguf_name is None:
            raise GGUFExportError(f"no llama.cpp tensor name for the draft's {hf_name!r}")
        out[gguf_name] = value.numpy()
    return out


def permute_for_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n_heads * D, hidden] q or k rows, per head from HF's halves layout (i, i + D/2) to llama.cpp's
    interleaved pairs (2i, 2i + 1): convert_hf_to_gguf.py's LlamaModel.permute."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _add_tensor(writer, name: str, value: np.ndarray, matrix_type) -> None:
    """Vectors (norms) in f32; matrices in `matrix_type`, f16 where rows do not fill q8_0 blocks;
    integer tables (EAGLE-3's d2t) as they are."""
    if value.dtype.kind == "i":
        writer.add_tensor(name, value)
        return
    if value.ndim == 1:
        writer.add_tensor(name, value.astype(np.float32))
        return
    block = gguf.GGML_QUANT_SIZES[matrix_type][0]
    if matrix_type == gguf.GGMLQuantizationType.F16 or value.shape[-1] % block:
        writer.add_tensor(name, value.astype(np.float16))
        return
    writer.add_tensor(name, gguf.quants.quantize(value, matrix_type), raw_dtype=matrix_type)
