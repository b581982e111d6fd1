"""A feature draft as llama.cpp's EAGLE-3 draft (`--format eagle3-gguf`): draft-f16.gguf and
draft-q8_0.gguf for `llama-speculative-simple -m target.gguf -md draft-f16.gguf --spec-type draft-eagle3`
(llama-server documents the same flags).

llama.cpp's `eagle3` architecture holds the same weights as the EAGLE-3 checkpoint vLLM and SGLang
load (distill/export/eagle3.py), under its own names:
  fc.weight                      fuses the three target layers (3 × width -> width)
  blk.0.attn_norm / attn_norm_2  the norms of the token embedding and of the fused target states
  blk.0.attn_{q,k,v}             read both, side by side (2 × width); q and k permuted for llama.cpp's
                                 rotary layout, as for any Llama (distill/export/gguf.py)
  blk.0.ffn_*, output_norm       as in a Llama layer
  output                         the head over the draft's rows
  d2t (int64)                    each row's target token id: absolute here, where the checkpoint
                                 stores the offset (token - row)
No token_embd: llama.cpp then embeds with the target's, as this project's decoder does.
Metadata: eagle3.target_layers, the target layers whose INPUT llama.cpp captures (our output ids + 1,
as vLLM counts), eagle3.target_hidden_size, and two flags for norms this draft does not have. The
tokenizer metadata is the target's, copied from its GGUF as for the standalone draft.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from distill.export.eagle3 import Eagle3ExportError, eagle3_config, eagle3_tensors
from distill.export.gguf import permute_for_rope, write_quants

ARCH = "eagle3"

# The EAGLE-3 checkpoint's names (distill/export/eagle3.py) -> llama.cpp's; t2d has no counterpart.
GGUF_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "d2t": "d2t",
}


def eagle3_gguf_tensors(draft, config: dict) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> array (fp32 weights, int64 d2t); q and k permuted for its rotary layout."""
    tensors = eagle3_tensors(draft)
    tensors["d2t"] = draft.draft_ids.cpu().to(torch.int64)
    heads = {"midlayer.self_attn.q_proj.weight": config["num_attention_heads"],
             "midlayer.self_attn.k_proj.weight": config["num_key_value_heads"]}
    out = {}
    for name, gguf_name in GGUF_NAMES.items():
        value = tensors[name]
        if name in heads:
            value = permute_for_rope(value, heads[name])
        out[gguf_name] = value.numpy() if name == "d2t" else value.float().numpy()
    return out


def write_eagle3_gguf(draft, target, fields: list, folder: Path) -> list[Path]:
    """Both GGUF files into a new `folder`; `target` is the target's HF config, `fields` its GGUF's
    tokenizer metadata (distill/export/gguf.tokenizer_fields)."""
    config = eagle3_config(draft, target)
    layers = config["eagle_aux_hidden_state_layer_ids"]
    if len(layers) != 3:  # src/models/eagle3.cpp refuses any other count when it loads the file
        raise Eagle3ExportError(f"llama.cpp's EAGLE-3 reads exactly three target layers; this draft reads "
                                f"{len(layers)} ({draft.config.target_layers}), so only the eagle3 format fits it")

    def add_eagle3_metadata(writer) -> None:
        writer.add_array(f"{ARCH}.target_layers", layers)
        writer.add_uint32(f"{ARCH}.target_hidden_size", config["target_hidden_size"])
        writer.add_bool(f"{ARCH}.norm_before_residual", False)
        writer.add_bool(f"{ARCH}.norm_before_fc", False)

    folder.mkdir()
    return write_quants(folder, "draft", ARCH, SimpleNamespace(**config), fields,
                        eagle3_gguf_tensors(draft, config), add_eagle3_metadata)
