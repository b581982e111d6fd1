"""A feature draft in the EAGLE-3 layout vLLM and SGLang load (`--format eagle3`): a one-layer
`LlamaForCausalLMEagle3` head that runs next to its target (vLLM `speculative_config={"method":
"eagle3", "model": <folder>}`, SGLang `--speculative-algorithm EAGLE3 --speculative-draft-model-path`).

config.json: a Llama config of one decoder layer at the target's width, with
  vocab_size            the target's vocabulary; draft_vocab_size: the rows of the head (its subset)
  target_hidden_size    the width of the target states `fc` reads
  eagle_aux_hidden_state_layer_ids, twice, because the two engines count differently:
    top level (vLLM, read first): the layer whose INPUT is captured. vLLM's Llama appends
      hidden + residual after layer i under id i + 1 (id 0: the embedding), so our output ids + 1;
    eagle_config (SGLang, the only place it reads): layer OUTPUT ids; SGLang adds the 1 itself.
  rope_theta and rope_parameters both (transformers 4 reads the first, 5 the second).
model.safetensors, under vLLM's llama_eagle3 names (its loader maps "midlayer." to layers.0.):
  fc.weight, midlayer.{input_layernorm (the embedding's norm), hidden_norm, self_attn.{q,k,v,o}_proj,
  post_attention_layernorm, mlp.{gate,up,down}_proj}.weight, norm.weight, lm_head.weight,
  d2t [N] int64: target id - row (the engines map row r to token r + d2t[r]),
  t2d [V] bool: whether a target id has a row (SGLang and vLLM skip it; kept for the layout's users).
No embed_tokens: both engines then share the target's embedding, as this project's decoder does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.errors import UserError
from decode.drafts.feature.model import FeatureDraft


ARCHITECTURE = "LlamaForCausalLMEagle3"

# This project's parameter names -> the EAGLE-3 checkpoint's.
WEIGHT_NAMES = {
    "fc.weight": "fc.weight",
    "embed_norm.weight": "midlayer.input_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_norm.weight": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


class Eagle3ExportError(UserError):
    """A feature draft the EAGLE-3 layout cannot describe exactly."""


def eagle3_config(draft: FeatureDraft, target) -> dict:
    """config.json of the export; `target` is the target's HF config."""
    c = draft.config
    last = target.num_hidden_layers - 1
    if last in c.target_layers:
        # This decoder reads the last layer after the final norm (as HF's output_hidden_states gives it);
        # the engines capture it before, so the exported head would read other values.
        raise Eagle3ExportError(f"the draft reads the target's last layer ({last}), which vLLM and SGLang "
                                "capture before the final norm and this project after it: not exportable exactly")
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.target_layers],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.target_layers), "use_aux_hidden_state": True},
        "bos_token_id": target.bos_token_id, "eos_token_id": target.eos_token_id,
        "pad_token_id": getattr(target, "pad_token_id", None),
        "torch_dtype": str(draft.fc.weight.dtype).removeprefix("torch."),
    }


def eagle3_tensors(draft: FeatureDraft) -> dict[str, torch.Tensor]:
    """The weights under their EAGLE-3 names, with the d2t offsets and the t2d mask."""
    state = draft.state_dict()
    tensors = {WEIGHT_NAMES[name]: state[name].detach().cpu().contiguous() for name in WEIGHT_NAMES}
    ids = draft.draft_ids.cpu()  # [N] target id of each row
    tensors["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(draft.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors


def write_eagle3(draft: FeatureDraft, target, folder: Path) -> None:
    """config.json and model.safetensors into a new `folder`; `target` is the target's HF config."""
    config = eagle3_config(draft, target)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(eagle3_tensors(draft), str(folder / "model.safetensors"))
