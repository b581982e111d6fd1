"""A lean batched Llama forward with a preallocated KV cache, for bulk sampling and scoring.

Why not HF `model.generate`: on a 2-core CPU the target's arithmetic is cheap next to the
framework around it. This runner reads the HF model's own weights (q/k/v and gate/up fused into
one matrix each, so a layer is 4 GEMMs), keeps the cache in one tensor per layer written by slot,
computes the LM head only where logits are needed, and drops finished rows.

Layout: prompts are LEFT-padded so every row's next token goes to the same cache slot. Row b has
pad_b pad slots; its token in slot j sits at position j - pad_b. Pad slots are masked out of every
attention, so they change nothing (tests compare against the HF forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Prefill at most this many (row x token) positions per forward: bounds activation memory
# (fp32 SmolLM2: 8192 positions x 3072 gate/up units x 4 B = 100 MB) and keeps GEMMs large.
PREFILL_CHUNK_POSITIONS = 8192


def lean_supported(model) -> bool:
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) == "llama" and config.hidden_act == "silu"
            and getattr(config, "pretraining_tp", 1) == 1 and not getattr(config, "draft_vocab_ids", None))


class BatchedLlama:
    """prefill(rows) -> last-position logits; step(tokens) -> next logits; keep(rows) drops rows."""

    def __init__(self, model, matmul_dtype: torch.dtype | None = None):
        """matmul_dtype=torch.bfloat16 keeps bf16 copies of the weight matrices and runs every GEMM in
        bf16 (fp32 accumulation); the residual stream, norms, attention and logits stay fp32. On this
        CPU (avx512_bf16) that doubles GEMM throughput for batches of >= 32 rows."""
        config = model.config
        cast = (lambda w: w.detach().to(matmul_dtype)) if matmul_dtype is not None else (lambda w: w.detach())
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.rotary = model.model.rotary_emb
        self.embed = model.model.embed_tokens.weight  # [V, H]
        self.final_norm = model.model.norm.weight
        self.head = cast(model.lm_head.weight)  # [V, H]; tied to embed for SmolLM2
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(dict(
                in_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                qkv=cast(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
                qkv_bias=(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
                          if attn.q_proj.bias is not None else None),
                o=cast(attn.o_proj.weight), o_bias=attn.o_proj.bias,
                gate_up=cast(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                gate_up_bias=(torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]).detach()
                              if mlp.gate_proj.bias is not None else None),
                down=cast(mlp.down_proj.weight), down_bias=mlp.down_proj.bias))
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    # ------------------------------------------------------------------ pieces of one layer
    def _rms(self, x, weight):
        # Same arithmetic as HF LlamaRMSNorm: fp32 statistics, cast back, then scale.
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def _linear(x, weight, bias=None):
        """GEMM in the weight's dtype, result in x's dtype."""
        return F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).to(x.dtype)

    @staticmethod
    def _rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _layers(self, x, positions, rows, slot0, read_from, mask):
        """x [B, L, H] for cache slots slot0..slot0+L-1 of the cache rows in slice `rows` -> hidden [B, L, H].

        Attention reads slots read_from..slot0+L-1 (mask [B, 1, L, that many])."""
        B, L, _ = x.shape
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.rotary(x, positions)  # [B, L, hd]
        cos, sin = cos[:, None], sin[:, None]
        for i, w in enumerate(self.layers):
            h = self._rms(x, w["in_norm"])
            qkv = self._linear(h, w["qkv"], w["qkv_bias"]).view(B, L, nq + 2 * nkv, hd).transpose(1, 2)
            q = self._rotate(qkv[:, :nq], cos, sin)  # [B, nq, L, hd]
            k = self._rotate(qkv[:, nq:nq + nkv], cos, sin)  # [B, nkv, L, hd]
            self.keys[i][rows, :, slot0:slot0 + L] = k
            self.values[i][rows, :, slot0:slot0 + L] = qkv[:, nq + nkv:]
            k_all = self.keys[i][rows, :, read_from:slot0 + L]  # [B, nkv, S, hd]
            v_all = self.values[i][rows, :, read_from:slot0 + L]
            a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=nq != nkv)
            x = x + self._linear(a.transpose(1, 2).reshape(B, L, nq * hd), w["o"], w["o_bias"])
            h = self._rms(x, w["post_norm"])
            gate, up = self._linear(h, w["gate_up"], w["gate_up_bias"]).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, w["down"], w["down_bias"])
        return self._rms(x, self.final_norm)

    @torch.inference_mode()
    def logits(self, hidden):
        return F.linear(hidden.to(self.head.dtype), self.head).float()

    # ------------------------------------------------------------------ public interface
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], capacity: int, all_hidden: bool = False):
        """Start a batch: left-pad prompts into a fresh cache of `capacity` slots per row.

        Returns fp32 logits [B, V] of each prompt's last token, or with all_hidden the final
        hidden states [B, L, H] of every slot (pads included) for teacher-forced scoring.
        """
        B, L = len(prompts), max(len(p) for p in prompts)
        assert capacity >= L
        device, dtype = self.embed.device, self.embed.dtype
        self.pad = torch.tensor([L - len(p) for p in prompts], device=device)  # [B]
        ids = torch.zeros(B, L, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
        shape = (B, self.num_kv_heads, capacity, self.head_dim)
        # Zeros, not empty: a decode step reads slots min(pad).. for every row, and a row prefilled in a
        # chunk of shorter prompts never writes the slots before its chunk's start (they are masked).
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.length = L
        self.read_from = int(self.pad.min())
        out = []
        for rows in self._chunks(prompts):
            # Each chunk is padded only to its own longest prompt: its rows use slots start..L-1.
            start = L - max(len(p) for p in prompts[rows])
            slots = torch.arange(start, L, device=device)
            pad = self.pad[rows, None, None, None]
            # Causal, pads excluded; a pad query attends to itself only so no row is all -inf.
            mask = ((slots[None, None, None, :] >= pad) & (slots[None, None, None, :] <= slots[:, None])) | (
                slots[None, None, None, :] == slots[:, None])  # [b, 1, L_chunk, L_chunk]
            positions = (slots[None, :] - self.pad[rows, None]).clamp(min=0)  # [b, L_chunk]
            hidden = self._layers(F.embedding(ids[rows, start:], self.embed), positions, rows, start, start, mask)
            if all_hidden:  # back to [b, L, H] so every row's slots line up
                hidden = F.pad(hidden, (0, 0, start, 0))
            out.append(hidden if all_hidden else self.logits(hidden[:, -1]))
        return torch.cat(out)

    @staticmethod
    def _chunks(prompts):
        """Consecutive row slices of <= PREFILL_CHUNK_POSITIONS padded positions each."""
        start, longest = 0, 0
        for end, p in enumerate(prompts):
            longest = max(longest, len(p))
            if end > start and (end + 1 - start) * longest > PREFILL_CHUNK_POSITIONS:
                yield slice(start, end)
                start, longest = end, len(p)
        yield slice(start, len(prompts))

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row [B] at the next slot -> fp32 logits [B, V]."""
        slot = self.length
        slots = torch.arange(self.read_from, slot + 1, device=tokens.device)
        mask = (slots[None, :] >= self.pad[:, None])[:, None, None, :]  # [B, 1, 1, slots]
        positions = (slot - self.pad)[:, None]  # [B, 1]
        hidden = self._layers(F.embedding(tokens[:, None], self.embed), positions, slice(None), slot,
                              self.read_from, mask)
        self.length += 1
        return self.logits(hidden[:, 0])

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only cache rows `rows` (in that order): finished rows stop costing compute."""
        live = self.length
        self.pad = self.pad[rows]
        self.read_from = int(self.pad.min())
        for i in range(len(self.layers)):
            # Copy only the filled slots; the cache keeps its capacity for the slots still to come.
            for cache in (self.keys, self.values):
                fresh = torch.empty((len(rows),) + cache[i].shape[1:], dtype=cache[i].dtype,
                                    device=cache[i].device)
                fresh[:, :, :live] = cache[i][rows, :, :live]
                cache[i] = fresh
