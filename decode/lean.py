"""A lean batch-1 Llama forward with a static KV cache: a drop-in for `ModelRunner`.

Why: batch-1 decoding of a small model on a CPU is limited by two things the Hugging Face
forward does not optimise for:
  * framework overhead per step (module calls, cache objects, mask building): most of a
    small draft's step;
  * the matmul of a handful of rows (verifying k + 1 tokens): MKL runs it far below the core's
    peak, while oneDNN with pre-packed weights runs up to ~12 rows in about the time of one.
This runner reads the HF model's weights (fusing q/k/v and gate/up into one matrix each, and
packing a oneDNN copy of every projection on CPU fp32)
and runs its own forward: RMSNorm, rotary embeddings from a precomputed table, grouped-query
attention over a preallocated cache written by position, SiLU MLP, and the output head only
for the rows asked for. Rolling back is just moving `length`.

It supports exactly the Llama variants it implements (`lean_supported`); anything else
falls back to the HF runner in `decode.runner.make_runner`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from decode.runner import subset_maps

# The cache (and rope table) grows in steps of this many positions instead of reserving
# max_position_embeddings (8192 for SmolLM2: 30 layers x 2 x 3 x 8192 x 64 x 4 B = 377 MB) up front.
CACHE_CHUNK = 256

_DTYPES = (torch.float32, torch.bfloat16)


# Rotary types whose frequencies are fixed when the model is built (Llama 3.x uses "llama3"), so the
# runner can read them once; "dynamic" recomputes them by length, yarn/longrope also scale attention.
STATIC_ROPE_TYPES = ("default", "linear", "llama3")


def lean_supported(model: torch.nn.Module) -> bool:
    """True when the model is a Llama this runner computes exactly like the HF forward."""
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
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "pretraining_tp", 1) == 1
        and getattr(model, "hf_quantizer", None) is None
        and all(p.dtype == params[0].dtype and p.device == params[0].device for p in params)
        and params[0].dtype in _DTYPES
    )


# Row counts (M) and layouts, measured on a 2-core AMD EPYC (Zen 4), fp32, 1 thread, ms for the
# matmuls of one SmolLM2-135M forward (30 layers + output head, weights streamed from memory):
#                         M = 1    2    3    5    9   12
#   torch.mm(w, x.T) (MKL)   30   31   50   61  111  146
#   oneDNN, packed weights   38   49   32   30   41   46
# (F.linear, layers only, another run: 35 58 69 56 64 for M = 1, 2, 3, 5, 9.)
# MKL runs 1-2 rows at memory speed but 3+ rows at a fraction of the core's AVX-512 peak;
# oneDNN with weights reordered once into its blocked layout runs 3-12 rows in about the time
# of one. So M >= PACKED_MIN_M uses the packed weights, M <= 2 uses w @ x.T (one row duplicated
# into two), except a small draft's layers (fewer than MIN_IN inputs and MIN_OUT outputs), where
# gemv is faster: 28-117 us vs 38-116 us per pair of layers. A draft's output head (8192 x 192
# for the demo's) is wide enough for w @ x.T to win: 0.38 ms vs 0.80 ms.
PACKED_MIN_M = 3
MIN_IN = 256
MIN_OUT = 4096


def _packed_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _Projection:
    """One weight w [out, in] with the layout each row count runs fastest in; called as x @ w.T.

    The packed copy (CPU fp32 only) doubles this weight's memory."""

    def __init__(self, w: torch.Tensor, cpu_fp32: bool):
        self.w = w
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 8) if cpu_fp32 and _packed_available() else None
        # w @ x.T for 1-2 rows, except a small draft layer's weight (gemv is faster there).
        self.mm_for_few_rows = cpu_fp32 and not (w.shape[1] < MIN_IN and w.shape[0] < MIN_OUT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> contiguous [M, out]."""
        m = x.shape[0]
        if self.packed is not None and m >= PACKED_MIN_M:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
        if m >= PACKED_MIN_M or not self.mm_for_few_rows:
            return F.linear(x, self.w)
        x = x.contiguous()
        if m == 1:
            x = torch.cat([x, x])  # [2, in]
        return torch.mm(self.w, x.t())[:, :m].t().contiguous()  # [out, 2 or M] -> [M, out]


class LeanLlamaRunner:
    """Batch-1 Llama forward with a static cache [layers, kv_heads, capacity, head_dim].

    Same interface as `decode.runner.ModelRunner`. The weights are read when the runner is
    built (fused copies of q/k/v and gate/up, views of the rest, and on CPU fp32 a packed copy
    of every projection: about 2x the model's size in extra memory, ~1 GB for SmolLM2-135M):
    build a new runner after changing the model's weights.
    """

    def __init__(self, model: LlamaForCausalLM, vocab_size: int):
        if not lean_supported(model):
            raise ValueError(f"the lean runner does not support this {type(model).__name__} configuration")
        cfg = model.config
        self.model = model
        self.vocab_size = vocab_size
        embed = model.model.embed_tokens.weight  # [V', hidden]
        self.device, self.dtype = embed.device, embed.dtype
        self.max_length = getattr(cfg, "max_position_embeddings", None) or 10**9

        self.subset_ids, self.input_map = subset_maps(cfg, vocab_size, self.device)

        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.q_proj.weight.shape[0] // self.n_heads
        self.eps = cfg.rms_norm_eps
        cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32

        with torch.no_grad():
            self.embed = embed
            self.layers = []
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append((
                    layer.input_layernorm.weight,  # [hidden]
                    _Projection(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), cpu_fp32),
                    _Projection(a.o_proj.weight, cpu_fp32),  # [hidden, H D]
                    layer.post_attention_layernorm.weight,  # [hidden]
                    _Projection(torch.cat([m.gate_proj.weight, m.up_proj.weight]), cpu_fp32),  # [2 I, hidden]
                    _Projection(m.down_proj.weight, cpu_fp32),  # [hidden, I]
                ))
            self.norm = model.model.norm.weight  # [hidden]
            # Output rows that mean tokens: the subset's N rows (not "other"), else the shared
            # vocabulary (embedding rows padded beyond it are never scored).
            n_out = self.subset_ids.shape[0] if self.subset_ids is not None else vocab_size
            self.lm_head = _Projection(model.lm_head.weight[:n_out], cpu_fp32)  # [n_out, hidden]
            if self.subset_ids is not None:
                self.scatter_index = self.subset_ids[None]  # [1, N]

        # The HF rotary module's own frequencies (after any static scaling; as the HF forward, in fp32
        # from whatever dtype the buffer now has).
        self.inv_freq = model.model.rotary_emb.inv_freq.float().to(self.device)  # [D / 2]
        self.capacity = 0
        self.reset()

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        """Drop cached positions >= length: stale entries are overwritten before they are read."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def _reserve(self, needed: int) -> None:
        """Grow the cache and the rope tables to hold `needed` positions."""
        if needed <= self.capacity:
            return
        if needed > self.max_length:
            raise ValueError(f"{needed} positions exceed the model's context of {self.max_length}")
        capacity = min(self.max_length, max(2 * self.capacity, -(-needed // CACHE_CHUNK) * CACHE_CHUNK))
        shape = (len(self.layers), self.n_kv, capacity, self.head_dim)
        # Zero-filled, not empty: a CUDA graph replay (decode.graphs) attends over the whole capacity
        # with a mask, and a masked key's value still enters the sum as 0 x value (NaN if garbage).
        k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            k_cache[:, :, : self.length] = self.k_cache[:, :, : self.length]
            v_cache[:, :, : self.length] = self.v_cache[:, :, : self.length]
        self.k_cache, self.v_cache = k_cache, v_cache  # each [layers, KV, capacity, D]
        # Rope tables computed in fp32 (as HF does), cast to the weights' dtype. rotate_half(x) * sin
        # is computed as roll(x, D/2) * sin_signed, sin_signed = [-sin(first half), sin(second half)].
        freqs = torch.outer(torch.arange(capacity, device=self.device).float(), self.inv_freq)  # [cap, D/2]
        self.cos = torch.cat([freqs, freqs], dim=-1).cos().to(self.dtype)  # [cap, D]
        self.sin_signed = torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(self.dtype)  # [cap, D]
        self.capacity = capacity

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Normalise in fp32, round to the weights' dtype, then scale (HF's order of rounding)."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * normed.to(x.dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        """Feed ids [n] at positions length..length+n-1; return fp32 logits [num_logits, vocab_size]
        (full_vocab=False: [num_logits, N] over a subset draft's rows)."""
        ids = ids.to(self.device)
        if self.input_map is not None:
            ids = self.input_map[ids]
        m, start = ids.shape[0], self.length
        assert 1 <= num_logits <= m, (num_logits, m)
        end = start + m
        self._reserve(end)
        # Query row i at position start + i sees keys 0..start + i (True = attend); the rows are
        # repeated per query head of a KV group (see _hidden).
        mask = None
        if m > 1:
            mask = torch.ones(m, end, dtype=torch.bool, device=self.device).tril(start)
            mask = mask.repeat(self.n_heads // self.n_kv, 1)
        x = self._hidden(ids, slice(start, end), end, mask)
        self.length = end
        return self._to_vocab(self._head(x[-num_logits:]), full_vocab)

    def _hidden(self, ids: torch.Tensor, positions, n_keys: int, mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder layers over ids [M] (embedding rows) at `positions` (a slice or a LongTensor [M]):
        writes their keys and values into the cache and attends over its first n_keys positions
        (mask [group M, n_keys], True = attend; None = all). Returns the residual stream [M, hidden]."""
        m = ids.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        group = H // KV
        cos, sin = self.cos[positions, None], self.sin_signed[positions, None]  # [M, 1, D]
        # The H query heads are laid out as KV groups x (group heads x M rows), [1, KV, group M, D],
        # so each group attends its one KV head.
        x = self.embed[ids]  # [M, hidden]
        for i, (w_in, w_qkv, w_o, w_post, w_gu, w_down) in enumerate(self.layers):
            qkv = w_qkv(self._rms_norm(x, w_in)).view(m, H + 2 * KV, D)
            qk = qkv[:, : H + KV]  # q and k heads get the same rotation: [M, H + KV, D]
            qk = qk * cos + qk.roll(D // 2, dims=-1) * sin
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]  # [KV, capacity, D]
            k_cache[:, positions] = qk[:, H:].transpose(0, 1)
            v_cache[:, positions] = qkv[:, H + KV :].transpose(0, 1)
            q = qk[:, :H].reshape(m, KV, group, D).permute(1, 2, 0, 3).reshape(1, KV, group * m, D)
            # SDPA's fused CPU kernel: as fast as bmm-softmax-bmm for M = 1, ~1.7x faster for M = 5.
            attn = F.scaled_dot_product_attention(q, k_cache[None, :, :n_keys], v_cache[None, :, :n_keys],
                                                  attn_mask=mask)  # [1, KV, group M, D]
            attn = attn.view(KV, group, m, D).permute(2, 0, 1, 3).reshape(m, H * D)
            x = x + w_o(attn)
            gate_up = w_gu(self._rms_norm(x, w_post))  # [M, 2 I]
            inter = gate_up.shape[1] // 2
            x = x + w_down(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual stream [M, hidden] -> fp32 logits [M, n_out] over the output rows."""
        return self.lm_head(self._rms_norm(x, self.norm)).float()

    def _to_vocab(self, logits: torch.Tensor, full_vocab: bool) -> torch.Tensor:
        """A subset draft's logits [M, N] spread over the full vocabulary (-inf elsewhere) if full_vocab."""
        if self.subset_ids is None or not full_vocab:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.scatter_(1, self.scatter_index.expand(logits.shape[0], -1), logits)
