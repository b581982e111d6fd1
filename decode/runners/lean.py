"""The lean Llama forward at batch 1, over a static cache rolled back by length (implements `Runner`).

Why: batch-1 decoding of a small model on a CPU is limited by framework overhead per step and by
the matmul of a handful of rows (verifying k + 1 tokens). This runner keeps a oneDNN-packed copy of
every projection on CPU fp32 (runners/projection.py), preallocates the cache and the rope table,
attends all query heads of a KV group in one SDPA call, and computes the output head only for the
rows asked for. Rolling back is just moving `length`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from decode.runners.llama import LlamaCore
from decode.runners.projection import ROW_BLOCK, Projection, rows_match_alone, tune_layouts
from decode.vocab import VocabSubset


# The cache (and rope table) grows in steps of this many positions instead of reserving
# max_position_embeddings (8192 for SmolLM2: 30 layers x 2 x 3 x 8192 x 64 x 4 B = 377 MB) up front.
CACHE_CHUNK = 256
# In bf16 every forward attends a multiple of this many keys, those beyond its rows' masked
# (`padded_attention_is_row_invariant`); CACHE_CHUNK is a multiple of it, so they lie in the cache.
KEY_BLOCK = 64


def padded_keys(n: int) -> int:
    """n keys rounded up to a multiple of KEY_BLOCK."""
    return -(-n // KEY_BLOCK) * KEY_BLOCK


class RollbackCache:
    """Keys and values [layers, KV, capacity, D] of one sequence, written by position.

    A forward's window is (positions, n_keys, mask, row_keys): its rows' positions (a slice or a
    LongTensor [M]), the cached positions attended (0..n_keys-1), mask [group M, n_keys] (True = attend;
    None = all), its rows repeated per query head of a KV group, and row_keys: None; or each row's own
    keys, attended alone: per row a count (the first ones) or slots [n] (those, in that order); or
    (slots [M, n], seen [M, n]): each row its slots' keys gathered in that order, attending where seen."""

    def __init__(self, core: LlamaCore, max_length: int):
        self.core, self.max_length = core, max_length
        self.capacity = 0

    def reserve(self, needed: int, filled: int) -> bool:
        """Grow the cache and the rope table to hold `needed` positions, keeping the first `filled`.
        True when the cache was reallocated."""
        if needed <= self.capacity:
            return False
        if needed > self.max_length:
            raise ValueError(f"{needed} positions exceed the model's context of {self.max_length}")
        capacity = min(self.max_length, max(2 * self.capacity, -(-needed // CACHE_CHUNK) * CACHE_CHUNK))
        c = self.core
        shape = (len(c.layers), c.n_kv, capacity, c.head_dim)
        # Zero-filled, not empty: a CUDA graph replay (runners/graphs.py) attends over the whole capacity
        # with a mask, and a masked key's value still enters the sum as 0 x value (NaN if garbage).
        keys = torch.zeros(shape, dtype=c.dtype, device=c.device)
        values = torch.zeros(shape, dtype=c.dtype, device=c.device)
        if self.capacity:
            keys[:, :, :filled] = self.keys[:, :, :filled]
            values[:, :, :filled] = self.values[:, :, :filled]
        self.keys, self.values = keys, values  # each [layers, KV, capacity, D]
        self.rope = c.rope_table(capacity)
        self.capacity = capacity
        return True

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window) -> torch.Tensor:
        """q [M, H, D], k and v [M, KV, D] -> [M, H D]."""
        positions, n_keys, mask, row_keys = window
        keys, values = self.keys[layer], self.values[layer]  # [KV, capacity, D]
        keys[:, positions] = k.transpose(0, 1)
        values[:, positions] = v.transpose(0, 1)
        if isinstance(row_keys, tuple):
            return self._attend_gathered(q, keys, values, *row_keys)
        if row_keys is not None:
            return torch.cat([self._attend(q[i : i + 1], keys[:, :n] if isinstance(n, int) else keys[:, n],
                                           values[:, :n] if isinstance(n, int) else values[:, n], None)
                              for i, n in enumerate(row_keys)])
        return self._attend(q, keys[:, :n_keys], values[:, :n_keys], mask)

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
        """q [M, H, D] over keys and values [KV, n, D] (mask [group M, n] or None) -> [M, H D]."""
        m, H, D = q.shape
        KV = keys.shape[0]
        group = H // KV
        # The H query heads laid out as KV groups x (group heads x M rows), [1, KV, group M, D], so each
        # group attends its one KV head.
        q = q.reshape(m, KV, group, D).permute(1, 2, 0, 3).reshape(1, KV, group * m, D)
        # SDPA's fused CPU kernel: as fast as bmm-softmax-bmm for M = 1, ~1.7x faster for M = 5.
        attn = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask)  # [1, KV, group M, D]
        return attn.view(KV, group, m, D).permute(2, 0, 1, 3).reshape(m, H * D)

    @staticmethod
    def _attend_gathered(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                         seen: torch.Tensor) -> torch.Tensor:
        """q [M, H, D], each row over the keys and values [KV, capacity, D] of its own slots [M, n], attending
        where seen [M, n]: one SDPA call whose batch entries are the rows -> [M, H D]."""
        (m, H, D), (KV, n) = q.shape, (keys.shape[0], slots.shape[1])
        group = H // KV
        flat = slots.reshape(-1)
        rows_keys = keys.index_select(1, flat).view(KV, m, n, D).transpose(0, 1)  # [M, KV, n, D]
        rows_values = values.index_select(1, flat).view(KV, m, n, D).transpose(0, 1)
        mask = seen[:, None, None, :].expand(m, KV, group, n)
        attn = F.scaled_dot_product_attention(q.reshape(m, KV, group, D), rows_keys, rows_values, attn_mask=mask)
        return attn.reshape(m, H * D)


def padded_attention_is_row_invariant(cache: RollbackCache, rows: int = 33, seed: int = 0) -> bool:
    """Whether SDPA gives a query row the same bits alone as among `rows` rows, keys padded to KEY_BLOCK.

    Why it matters: a bf16 forward must give row i the logits a one-token forward gives it, or verifying
    k tokens and decoding them one by one give other greedy tokens (lossless means token for token).
    The matmuls are (runners/projection.py); SDPA's fused CPU kernel is not when the rows attend their
    exact key counts: from 5 rows on it sums a row's keys in another order (~6e-5 apart on a 2-core AMX
    Xeon, torch 2.13), which bf16 rounds into 0.5 in the logits 30 layers later. Attending a multiple of
    KEY_BLOCK keys, those beyond a row's own masked, gave every row the same bits alone and among 2-65
    rows there, at ~1 ms more per one-token step. The kernel is the library's to change, so each runner
    checks it on random rows (a few ms); where it fails, rows attend one by one (`by_row`, exact by
    construction, r(32) 2.6 instead of 1.5 target steps)."""
    core = cache.core
    gen = torch.Generator(device="cpu").manual_seed(seed)
    H, KV, D, group = core.n_heads, core.n_kv, core.head_dim, core.n_heads // core.n_kv
    for prefix in (60, 130):  # block rows ending inside a KEY_BLOCK and across one
        n = padded_keys(prefix + rows)
        keys, values, q = (torch.randn(shape, generator=gen).to(core.dtype)
                           for shape in ((KV, n, D), (KV, n, D), (rows, H, D)))
        seen = torch.arange(n)[None, :] <= torch.arange(prefix, prefix + rows)[:, None]  # [rows, n]
        block = RollbackCache._attend(q, keys, values, seen.repeat(group, 1))
        for i in (0, rows // 2, rows - 1):
            alone = padded_keys(prefix + i + 1)
            one = RollbackCache._attend(q[i : i + 1], keys[:, :alone], values[:, :alone], seen[i : i + 1, :alone])
            if not torch.equal(one[0], block[i]):
                return False
    return True


class LeanRunner:
    """Batch-1 lean Llama forward over a `RollbackCache` (implements `decode.runners.Runner`).

    On a CPU in fp32 each weight shape's layouts are timed when the runner is built (runners/projection.py,
    once per process: ~2 s for SmolLM2-135M); a projection whose fastest layout is oneDNN's keeps a
    packed copy of its weight (up to the model's size again, ~0.5 GB for SmolLM2-135M). In bf16 every
    row gets the bits a one-token forward gives it (`row_invariance`, docs/decoder.md). Build a new runner
    after changing the model's weights."""

    def __init__(self, model: LlamaForCausalLM, vocab_size: int, hidden_layers: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.subset = VocabSubset.of(model)
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 10**9
        self.hidden_layers = tuple(hidden_layers)
        self.hidden_states: torch.Tensor | None = None
        # Output rows the decoder scores: a subset draft's (decode.vocab.VocabSubset.head_rows), else the
        # shared vocabulary (embedding rows padded beyond it are never scored).
        head_rows = self.subset.head_rows if self.subset is not None else vocab_size
        self.core = LlamaCore(model, head_rows, Projection)
        tune_layouts(self.core.projections())
        n_layers = len(self.core.layers)
        if any(not 0 <= i < n_layers for i in self.hidden_layers):
            raise ValueError(f"hidden_layers {self.hidden_layers} outside the model's {n_layers} layers")
        self.group = self.core.n_heads // self.core.n_kv
        self.cache = RollbackCache(self.core, self.max_length)
        # bf16 on a CPU: no row's result may depend on the rows beside it (its matmuls: ROW_BLOCK rows at
        # most, or one where even that fails here; its attention: `row_invariance`).
        self.row_invariance = None
        if self.device.type == "cpu" and self.core.dtype == torch.bfloat16:
            if not rows_match_alone(self.core.projections(), ROW_BLOCK):
                for projection in self.core.projections():
                    projection.row_block = 1
            self.row_invariance = "padded" if padded_attention_is_row_invariant(self.cache) else "by_row"
        self.reset()

    @property
    def capacity(self) -> int:
        """Positions the cache holds before it has to grow."""
        return self.cache.capacity

    def reset(self) -> None:
        self.length = self.forward_start = 0

    def rollback(self, length: int) -> None:
        """Drop cached positions >= length: stale entries are overwritten before they are read."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def reserve(self, needed: int) -> bool:
        """Make room for `needed` positions; True when the cache was reallocated (new addresses)."""
        return self.cache.reserve(needed, self.length)

    def advance(self, n: int) -> None:
        """Count n more positions as cached: the ones `forward_at` just wrote after `length`."""
        self.length += n

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, num_logits: int = 1, full_vocab: bool = True) -> torch.Tensor:
        """Feed ids [n] at positions length..length+n-1; return fp32 logits [num_logits, vocab_size]
        (full_vocab=False: [num_logits, N] over a subset draft's rows)."""
        ids = ids.to(self.device)
        rows = ids if self.subset is None else self.subset.rows(ids)
        m, start = rows.shape[0], self.length
        assert 1 <= num_logits <= m, (num_logits, m)
        end = start + m
        self.reserve(end)
        x = self._decoder_layers(rows, slice(start, end), self._window(start, end))
        self.length, self.forward_start = end, start
        return self.to_vocab(self.core.logits(self.core.norm(x[-num_logits:])), full_vocab)

    @torch.inference_mode()
    def forward_masked(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                       num_logits: int, full_vocab: bool = True) -> torch.Tensor:
        """Feed ids [m] into slots length..length+m-1 at rotary `positions` [m], row i attending the slots
        where visible [m, length + m] is True (a draft tree, decode/tree.py); return fp32 logits
        [num_logits, vocab_size] of the last num_logits rows (full_vocab as `forward`)."""
        ids = ids.to(self.device)
        rows = ids if self.subset is None else self.subset.rows(ids)
        m, start = rows.shape[0], self.length
        end = start + m
        assert visible.shape == (m, end) and 1 <= num_logits <= m, (tuple(visible.shape), m, end, num_logits)
        self.reserve(end)
        x = self._decoder_layers(rows, positions.to(self.device), self._window(start, end, visible.to(self.device)))
        self.length, self.forward_start = end, start
        return self.to_vocab(self.core.logits(self.core.norm(x[-num_logits:])), full_vocab)

    @torch.inference_mode()
    def keep(self, length: int, slots: list[int]) -> None:
        """Keep the cached positions before `length`, then the slots `slots` (increasing, each >= length;
        a tree's accepted path) moved to length, length + 1, ...; the last forward's hidden states are
        reindexed the same way."""
        assert self.forward_start <= length <= self.length and all(length <= s < self.length for s in slots)
        if slots:
            index = torch.tensor(slots, device=self.device)
            for store in (self.cache.keys, self.cache.values):  # [layers, KV, capacity, D]
                store[:, :, length : length + len(slots)] = store[:, :, index]
        if self.hidden_states is not None:
            rows = list(range(length - self.forward_start)) + [s - self.forward_start for s in slots]
            self.hidden_states = self.hidden_states[rows]
        self.length = length + len(slots)

    def forward_at(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   visible: torch.Tensor) -> torch.Tensor:
        """The forward with fixed shapes and addresses that a CUDA graph captures: embedding rows [M] at
        rotary positions [M], their keys and values written into cache slots [M] by index, row i attending
        the cache slots where visible [M, capacity] is True (device tensors, read when run; the cache is
        zero-filled, so masked keys stay finite). Returns fp32 logits [M, head rows] of every row and keeps
        `hidden_states` as `forward` does. `length` does not move (see `advance`); the cache must already
        hold the slots."""
        window = (slots, self.cache.capacity, visible.repeat(self.group, 1), None)
        x = self._decoder_layers(rows, positions, window)
        return self.core.logits(self.core.norm(x))

    def _window(self, start: int, end: int, visible: torch.Tensor | None = None) -> tuple:
        """The cache window (RollbackCache) of a forward writing slots start..end-1: causal, or row i
        attending the slots where visible [end - start, end] is True."""
        m = end - start
        tree = visible is not None
        if not tree:  # causal: row i sees keys 0..start + i
            visible = torch.ones(m, end, dtype=torch.bool, device=self.device).tril(start) if m > 1 else None
        if self.row_invariance == "by_row" and m > 1:
            counts = visible.sum(1).tolist()
            # A row whose keys are the first ones attends that prefix, as a one-token forward does.
            row_keys = [n if bool(row[:n].all()) else row.nonzero().squeeze(1) for n, row in zip(counts, visible)]
            return slice(start, end), end, None, row_keys
        if self.row_invariance == "padded" and tree:
            # A tree row's keys (the text, then its ancestors) lie among other nodes' slots: masked gaps
            # would put them in other lanes of SDPA's sums than a one-token forward's contiguous keys, so
            # each row attends its keys gathered in order, padded as that forward's are (~7 ms more for
            # 17 rows over 128 keys on the AMX Xeon: the gather).
            counts = visible.sum(1)
            n_keys = padded_keys(int(counts.max()))
            # Each row's slots in increasing order, then slot 0 as padding: sorting by "not visible" (stable)
            # puts the visible slots first, in order.
            order = torch.sort((~visible).to(torch.uint8), dim=1, stable=True).indices  # [M, end]
            slots = torch.zeros(m, n_keys, dtype=torch.long, device=self.device)
            width = min(n_keys, end)
            slots[:, :width] = order[:, :width]
            seen = torch.arange(n_keys, device=self.device)[None, :] < counts[:, None]
            return slice(start, end), end, None, (slots.masked_fill(~seen, 0), seen)
        if self.row_invariance == "padded":
            n_keys = min(padded_keys(end), self.cache.capacity)
            mask = torch.zeros(m, n_keys, dtype=torch.bool, device=self.device)
            mask[:, :end] = True if visible is None else visible
            return slice(start, end), n_keys, mask.repeat(self.group, 1), None
        return slice(start, end), end, None if visible is None else visible.repeat(self.group, 1), None

    def _decoder_layers(self, rows: torch.Tensor, positions, window) -> torch.Tensor:
        """The residual stream [M, hidden]; keeps `hidden_states` of the layers asked for."""
        x, kept = self.core.decoder_layers(rows, positions, self.cache, window, self.hidden_layers)
        self.hidden_states = torch.stack(kept, dim=1) if kept else None  # [M, len(hidden_layers), hidden]
        return x

    def to_vocab(self, row_logits: torch.Tensor, full_vocab: bool) -> torch.Tensor:
        """Logits over the head's rows [M, rows] -> [M, vocab_size] (a subset draft's through
        VocabSubset.full_logits), or a subset draft's N token rows when not full_vocab."""
        if self.subset is None:
            return row_logits
        return self.subset.full_logits(row_logits) if full_vocab else row_logits[:, : self.subset.size]
