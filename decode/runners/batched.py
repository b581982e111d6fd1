"""The lean Llama forward over many left-padded rows, for bulk sampling and scoring (implements `BatchedRunner`).

Why not HF `model.generate`: on a 2-core CPU the target's arithmetic is cheap next to the framework
around it. This runner keeps the cache in one tensor per layer written by slot, computes the output
head only where logits are needed, and drops finished rows.

Layout: prompts are LEFT-padded so every row's next token goes to the same cache slot. Row b has
pad_b pad slots; its token in slot j sits at position j - pad_b. Pad slots are masked out of every
attention, so they change nothing (tests compare against the HF forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from decode.runners.llama import LlamaCore
from decode.runners.projection import CastProjection, tune_batched_layouts


# Prefill at most this many (row x token) positions per forward: bounds activation memory
# (fp32 SmolLM2: 8192 positions x 3072 gate/up units x 4 B = 100 MB) and keeps GEMMs large.
PREFILL_CHUNK_POSITIONS = 8192


class BatchedCache:
    """Keys and values [B, KV, capacity, D] per layer in `dtype`, row b left-padded by pad[b] slots.

    A forward's window is (rows, slot0, read_from, mask): the cache rows fed (a slice), the first
    slot written, the first slot attended (slots read_from..slot0+L-1) and mask [b, 1, L, those slots]
    (True = attend)."""

    def __init__(self, core: LlamaCore, pad: torch.Tensor, length: int, capacity: int, dtype: torch.dtype):
        shape = (pad.shape[0], core.n_kv, capacity, core.head_dim)
        # Empty: every slot is written before it is read, but for those prefill_window zeroes. Zeroing the
        # whole cache (2.4 GB for 128 rows of the demo's longest prompts) was an eighth of such a prefill.
        self.keys = [torch.empty(shape, dtype=dtype, device=core.device) for _ in core.layers]
        self.values = [torch.empty(shape, dtype=dtype, device=core.device) for _ in core.layers]
        self.rope = core.rope_table(capacity)  # positions never exceed slots
        self.pad = pad  # [B]
        self.length = length  # slots filled
        self.read_from = int(pad.min())

    def prefill_window(self, rows: slice, start: int) -> tuple[torch.Tensor, tuple]:
        """Positions [b, L - start] and window of cache rows `rows` over slots start..length-1.

        Slots min(pad)..start-1 are zeroed: a decode step reads them for every row, and these rows (a chunk
        of shorter prompts) never write them. Masked, but a masked slot must still not hold NaN."""
        if start > self.read_from:
            for cache in (self.keys, self.values):
                for layer in cache:
                    layer[rows, :, self.read_from:start] = 0
        slots = torch.arange(start, self.length, device=self.pad.device)
        pad = self.pad[rows, None, None, None]
        # Causal, pads excluded; a pad query attends to itself only so no row is all -inf.
        mask = ((slots[None, None, None, :] >= pad) & (slots[None, None, None, :] <= slots[:, None])) | (
            slots[None, None, None, :] == slots[:, None])  # [b, 1, L_chunk, L_chunk]
        positions = (slots[None, :] - self.pad[rows, None]).clamp(min=0)  # [b, L_chunk]
        return positions, (rows, start, start, mask)

    def step_window(self) -> tuple[torch.Tensor, tuple]:
        """Positions [B, 1] and window of every row's next slot."""
        slot = self.length
        slots = torch.arange(self.read_from, slot + 1, device=self.pad.device)
        mask = (slots[None, :] >= self.pad[:, None])[:, None, None, :]  # [B, 1, 1, slots]
        positions = (slot - self.pad)[:, None]  # [B, 1]
        return positions, (slice(None), slot, self.read_from, mask)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window) -> torch.Tensor:
        """q [b, L, H, D], k and v [b, L, KV, D] -> [b, L, H D]."""
        rows, slot0, read_from, mask = window
        b, L, H, D = q.shape
        end = slot0 + L
        self.keys[layer][rows, :, slot0:end] = k.transpose(1, 2)
        self.values[layer][rows, :, slot0:end] = v.transpose(1, 2)
        k_all = self.keys[layer][rows, :, read_from:end]  # [b, KV, S, D]
        v_all = self.values[layer][rows, :, read_from:end]
        a = F.scaled_dot_product_attention(q.transpose(1, 2).to(k_all.dtype), k_all, v_all, attn_mask=mask,
                                           enable_gqa=H != k.shape[2])  # [b, H, L, D]
        return a.transpose(1, 2).reshape(b, L, H * D).to(q.dtype)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only cache rows `rows` (in that order)."""
        self.pad = self.pad[rows]
        self.read_from = int(self.pad.min())
        for cache in (self.keys, self.values):
            for i, layer in enumerate(cache):
                # Copy only the filled slots; the cache keeps its capacity for the slots still to come.
                fresh = torch.empty((len(rows),) + layer.shape[1:], dtype=layer.dtype, device=layer.device)
                fresh[:, :, : self.length] = layer[rows, :, : self.length]
                cache[i] = fresh


class LeanBatchedRunner:
    """prefill(rows) -> last-position logits; step(tokens) -> next logits; keep(rows) drops rows.

    For targets: a vocabulary-subset draft is refused. hidden_layers: decoder layers whose outputs each
    prefill and step also keep in `hidden_states` (the last layer's after the final norm), as
    generate.features stores them for a feature draft."""

    def __init__(self, model, matmul_dtype: torch.dtype | None = None, hidden_layers: tuple[int, ...] = ()):
        """matmul_dtype=torch.bfloat16 runs every GEMM in bf16 (fp32 accumulation) on bf16 copies of the
        weight matrices and keeps the cache's keys and values in bf16; the residual stream, norms and
        logits keep the model's dtype.

        Why bf16 keys and values: at batch 128 a decode step's attention reads the whole cache, and on a
        2-core AMX Xeon it was half of a step in fp32 (75 of 152 ms at ~140 slots); bf16 halves the bytes
        read. Against the fp32 forward, teacher-forced over 1,523 of the demo's completion tokens, the bf16
        runner's mean KL was 6.14e-4 nats with bf16 keys and values and 6.15e-4 with fp32 ones
        (scripts/bench_generate.py's bf16_accuracy)."""
        head_rows = model.lm_head.weight.shape[0]  # every row: padded ones too (never sampled by design)
        self.core = LlamaCore(model, head_rows, lambda w, bias: CastProjection(w, bias, matmul_dtype))
        self.cache_dtype = matmul_dtype or self.core.dtype
        tune_batched_layouts(self.core.projections())
        self.cache: BatchedCache | None = None
        self.hidden_layers = tuple(hidden_layers)
        self.hidden_states: torch.Tensor | None = None
        """With hidden_layers: after prefill [B, L, len(hidden_layers), H] of every slot (pads included, as
        zeros), after step [B, len(hidden_layers), H] of the token fed; in the residual stream's dtype."""

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.core.logits(hidden)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], capacity: int, all_hidden: bool = False) -> torch.Tensor:
        """Start a batch: left-pad prompts into a fresh cache of `capacity` slots per row.

        Returns fp32 logits [B, V] of each prompt's last token, or with all_hidden the final
        hidden states [B, L, H] of every slot (pads included) for teacher-forced scoring.
        """
        B, L = len(prompts), max(len(p) for p in prompts)
        assert capacity >= L
        device = self.core.device
        pad = torch.tensor([L - len(p) for p in prompts], device=device)  # [B]
        ids = torch.zeros(B, L, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
        self.cache = BatchedCache(self.core, pad, L, capacity, self.cache_dtype)
        out, kept_states = [], []
        for rows in self._chunks(prompts):
            # Each chunk is padded only to its own longest prompt: its rows use slots start..L-1.
            start = L - max(len(p) for p in prompts[rows])
            positions, window = self.cache.prefill_window(rows, start)
            x, kept = self.core.decoder_layers(ids[rows, start:], positions, self.cache, window, self.hidden_layers)
            hidden = self.core.norm(x)  # [b, L - start, H]
            if all_hidden:  # back to [b, L, H] so every row's slots line up
                hidden = F.pad(hidden, (0, 0, start, 0))
            out.append(hidden if all_hidden else self.core.logits(hidden[:, -1]))
            if kept:
                kept_states.append(F.pad(torch.stack(kept, dim=2), (0, 0, 0, 0, start, 0)))  # [b, L, layers, H]
        self.hidden_states = torch.cat(kept_states) if kept_states else None
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
        positions, window = self.cache.step_window()
        x, kept = self.core.decoder_layers(tokens[:, None], positions, self.cache, window, self.hidden_layers)
        self.cache.length += 1
        self.hidden_states = torch.stack(kept, dim=1)[:, :, 0] if kept else None  # [B, layers, H]
        return self.core.logits(self.core.norm(x[:, 0]))

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only cache rows `rows` (in that order): finished rows stop costing compute."""
        self.cache.keep(rows)
        if self.hidden_states is not None:
            self.hidden_states = self.hidden_states[rows]
