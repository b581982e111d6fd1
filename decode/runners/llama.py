"""The lean Llama forward: the weights read once from an HF model, and one decoder-layer loop.

Why not the HF forward: at batch 1 on a CPU, framework overhead per step (module calls, cache
objects, mask building) is most of a small draft's step, and a few rows' matmuls run far below
the core's peak unless laid out for it (runners/projection.py); in bulk generation on a 2-core CPU
the target's arithmetic is cheap next to the framework around it.

`LlamaCore` holds the weights (q/k/v and gate/up fused into one matrix each, so a layer is 4
GEMMs; norms; the output head's rows) and computes RMSNorm, rotary embeddings from a precomputed
table and each layer: norm -> qkv -> rope -> write cache -> attention -> o -> norm -> gate/up ->
silu -> down (silu and the product fused into the GEMMs where oneDNN runs them packed). How keys and
values are stored and attended (and with which mask) belongs to the cache layout passed in:
`RollbackCache` (runners/lean.py, batch 1) or `BatchedCache`
(runners/batched.py, left-padded rows). Both runners are tested against the HF forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import LlamaForCausalLM

from decode.runners.projection import silu_gate


_DTYPES = (torch.float32, torch.bfloat16)

# Rotary types whose frequencies are fixed when the model is built (Llama 3.x uses "llama3"), so the
# runner can read them once; "dynamic" recomputes them by length, yarn/longrope also scale attention.
STATIC_ROPE_TYPES = ("default", "linear", "llama3")


def lean_supported(model: torch.nn.Module) -> bool:
    """True when the model is a Llama the lean forward computes exactly like the HF forward."""
    if not isinstance(model, LlamaForCausalLM):
        return False
    cfg = model.config
    rotary = getattr(model.model, "rotary_emb", None)
    attn = model.model.layers[0].self_attn
    head_dim = attn.q_proj.weight.shape[0] // cfg.num_attention_heads
    params = list(model.parameters())
    return (
        getattr(rotary, "rope_type", None) in STATIC_ROPE_TYPES
        and getattr(rotary, "attention_scaling", None) == 1.0
        and 2 * rotary.inv_freq.numel() == head_dim  # rotates the whole head (no partial rotary)
        and cfg.hidden_act == "silu"
        and getattr(cfg, "pretraining_tp", 1) == 1
        and getattr(model, "hf_quantizer", None) is None
        and all(p.dtype == params[0].dtype and p.device == params[0].device for p in params)
        and params[0].dtype in _DTYPES
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, round to the weights' dtype, then scale (HF's order of rounding)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RotaryTable:
    """cos and signed sin [capacity, D] of positions 0..capacity-1.

    Computed in fp32 (as HF does), cast to the weights' dtype. rotate_half(x) * sin is computed as
    roll(x, D/2) * sin_signed, sin_signed = [-sin(first half), sin(second half)]."""

    def __init__(self, inv_freq: torch.Tensor, capacity: int, dtype: torch.dtype):
        freqs = torch.outer(torch.arange(capacity, device=inv_freq.device).float(), inv_freq)  # [cap, D/2]
        self.cos = torch.cat([freqs, freqs], dim=-1).cos().to(dtype)  # [cap, D]
        self.sin_signed = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(dtype)  # [cap, D]

    def at(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed [..., 1, D] at positions [...] (a slice or a LongTensor), broadcast over heads."""
        return self.cos[positions].unsqueeze(-2), self.sin_signed[positions].unsqueeze(-2)


class LayerCache(Protocol):
    """What the layer loop asks of a cache layout."""

    rope: RotaryTable

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window) -> torch.Tensor:
        """Write k, v [..., KV, D] of `layer` where `window` says, attend q [..., H, D] over the keys it
        allows -> [..., H D]. `window` is the layout's own description of this forward's slots and mask."""


# A projection of the residual stream: x [..., in] -> x @ w.T + bias [..., out] (runners/projection.py).
Project = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LlamaLayer:
    """One decoder layer's norms and projections."""

    in_norm: torch.Tensor  # [hidden]
    qkv: Project  # [(H + 2 KV) D, hidden]
    o: Project  # [hidden, H D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Project  # [2 I, hidden]
    down: Project  # [hidden, I]


def swiglu(gate_up: Project, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [..., I] from one fused gate/up projection [2 I, hidden] of x [..., hidden]; a
    projection that fuses the activation into its GEMMs (CastProjection.gated) computes it itself."""
    gated = getattr(gate_up, "gated", None)
    return gated(x) if gated is not None else silu_gate(gate_up(x))


def _fused(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of outs, in] (and bias) computing several linears of the same input."""
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
    return weight, bias


class LlamaCore:
    """The weights of a `lean_supported` Llama and its forward, cache layout passed in.

    `project(w, bias)` lays out each matrix (runners/projection.py). The weights are read when the
    core is built (fused copies of q/k/v and gate/up, views of the rest): build a new core after
    changing the model's weights. `head_rows`: output-head rows scored (rows beyond it, such as a
    padded embedding's, never are)."""

    def __init__(self, model: LlamaForCausalLM, head_rows: int,
                 project: Callable[[torch.Tensor, torch.Tensor | None], Project]):
        if not lean_supported(model):
            raise ValueError(f"the lean forward does not support this {type(model).__name__} configuration")
        cfg = model.config
        self.embed = model.model.embed_tokens.weight  # [V', hidden]
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.q_proj.weight.shape[0] // self.n_heads
        self.eps = cfg.rms_norm_eps
        with torch.no_grad():
            self.layers = [self._layer(layer, project) for layer in model.model.layers]
            self.norm_weight = model.model.norm.weight  # [hidden]
            self.head = project(model.lm_head.weight[:head_rows], None)  # [head_rows, hidden]
        # The HF rotary module's own frequencies (after any static scaling; as the HF forward, in fp32
        # from whatever dtype the buffer now has).
        self.inv_freq = model.model.rotary_emb.inv_freq.float().to(self.device)  # [D / 2]

    @staticmethod
    def _layer(layer, project) -> LlamaLayer:
        a, m = layer.self_attn, layer.mlp
        return LlamaLayer(
            in_norm=layer.input_layernorm.weight,
            qkv=project(*_fused(a.q_proj, a.k_proj, a.v_proj)),
            o=project(a.o_proj.weight, a.o_proj.bias),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=project(*_fused(m.gate_proj, m.up_proj)),
            down=project(m.down_proj.weight, m.down_proj.bias),
        )

    def projections(self) -> list[Project]:
        """Every projection, in the order a forward runs them (the output head last)."""
        return [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.head]

    def rope_table(self, capacity: int) -> RotaryTable:
        return RotaryTable(self.inv_freq, capacity, self.dtype)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm, before the output head."""
        return rms_norm(x, self.norm_weight, self.eps)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Final (normed) hidden states [..., hidden] -> fp32 logits [..., head_rows]."""
        return self.head(normed).float()

    def decoder_layers(self, rows: torch.Tensor, positions, cache: LayerCache, window,
                       keep: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embedding rows [...] at `positions` (same shape, or a slice for a 1-D run) through every layer.

        Returns the residual stream [..., hidden] and the outputs of the layers in `keep`, in its order,
        as HF's output_hidden_states reports them (the last layer's after the final norm)."""
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        cos, sin = cache.rope.at(positions)  # [..., 1, D]
        x = self.embed[rows]  # [..., hidden]
        kept = {}
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(rms_norm(x, layer.in_norm, self.eps)).view(*x.shape[:-1], H + 2 * KV, D)
            qk = qkv[..., : H + KV, :]  # q and k heads get the same rotation: [..., H + KV, D]
            qk = qk * cos + qk.roll(D // 2, dims=-1) * sin
            attn = cache.attend(i, qk[..., :H, :], qk[..., H:, :], qkv[..., H + KV :, :], window)  # [..., H D]
            x = x + layer.o(attn)
            x = x + layer.down(swiglu(layer.gate_up, rms_norm(x, layer.post_norm, self.eps)))
            if i in keep:
                kept[i] = self.norm(x) if i == len(self.layers) - 1 else x
        return x, [kept[i] for i in keep]
