"""The lean Llama forward over many rows that each keep their own length: batched speculative decoding.

Rows accept different numbers of drafted tokens, so their committed texts grow unevenly. Each row keeps
its text as a batch-1 cache does: the token at position p in slot p of its row. A forward writes row b's
L tokens at its own next positions, rolling a row back only lowers its length (the stale slots are
overwritten before any query attends them), and a row joining later starts at slot 0 of a fresh row. Every
query attends its row's slots 0..its own position, the keys a batch-1 forward of that row attends, in the
same slots, so attention over a row is exactly the batch-1 forward's (tests compare them). The cache grows
in CACHE_CHUNK steps only when the longest row's text and its block of guesses need it.

In bf16 on a CPU a row must also get the bits a one-token batch-1 forward gives it (decode/runners/lean.py):
matmuls of at most ROW_BLOCK rows and queries attending a multiple of KEY_BLOCK keys, those beyond their own
masked, laid out per KV group as the batch-1 runner lays them out; where the checks at build time find
other bits, queries attend alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from decode.runners.lean import CACHE_CHUNK, RollbackCache, padded_attention_is_row_invariant, padded_keys
from decode.runners.llama import LlamaCore
from decode.runners.projection import ROW_BLOCK, Projection, rows_match_alone, tune_layouts
from decode.vocab import VocabSubset


class RaggedCache:
    """Keys and values [B, KV, capacity, D] per layer, row b's position p in slot p; next_position [B].

    alone: None (all queries in one SDPA call), or how a query attends by itself: "padded" (KEY_BLOCK
    multiples, as a bf16 one-token batch-1 forward) or "exact" (its own keys only)."""

    def __init__(self, core: LlamaCore, padded: bool = False, alone: str | None = None):
        self.core, self.padded, self.alone = core, padded, alone
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.next_position = torch.zeros(0, dtype=torch.long, device=core.device)
        self.capacity = 0
        self.rope = core.rope_table(CACHE_CHUNK)

    @property
    def rows(self) -> int:
        return self.next_position.shape[0]

    def reserve(self, rows: int, slots: int) -> None:
        """Room for `rows` rows (new ones empty) and every row's next `slots` positions, keeping what is cached."""
        c = self.core
        needed = (int(self.next_position.max()) if self.rows else 0) + slots
        if rows <= self.rows and needed <= self.capacity:
            return
        rows, capacity = max(rows, self.rows), max(self.capacity, -(-needed // CACHE_CHUNK) * CACHE_CHUNK)
        # Zero-filled: a masked key's value still enters SDPA's sum as 0 x value (NaN if garbage).
        shape = (rows, c.n_kv, capacity, c.head_dim)
        for store in (self.keys, self.values):
            for i in range(len(c.layers)):
                grown = torch.zeros(shape, dtype=c.dtype, device=c.device)
                if i < len(store):
                    grown[: store[i].shape[0], :, : self.capacity] = store[i]
                    store[i] = grown
                else:
                    store.append(grown)
        self.next_position = F.pad(self.next_position, (0, rows - self.rows))
        self.capacity = capacity
        if capacity > self.rope.cos.shape[0]:
            self.rope = c.rope_table(capacity)

    def feed(self, rows: torch.Tensor | None, counts: torch.Tensor, width: int) -> tuple[torch.Tensor, tuple]:
        """Slots for a forward of `width` tokens per row to cache rows `rows` (None: every row, in order),
        row i's first counts[i] real (the rest padding: written past the row's length, so never attended by a
        real query). Returns the tokens' positions [b, width] (also their slots) and the window `attend`
        takes, and advances the rows past their real tokens."""
        self.reserve(self.rows, width)
        device = self.next_position.device
        index = slice(None) if rows is None else rows  # every row: a slice, so attention reads the cache in place
        row_ids = torch.arange(self.rows, device=device)[index]
        positions = self.next_position[index, None] + torch.arange(width, device=device)  # [b, width]
        n_keys = int(positions.max()) + 1
        if self.padded:
            n_keys = min(padded_keys(n_keys), self.capacity)
        seen = torch.arange(n_keys, device=device)[None, None, :] <= positions[:, :, None]  # [b, width, n_keys]
        self.next_position[index] += counts
        return positions, (index, row_ids, positions, seen)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Row i keeps its first lengths[i] tokens."""
        self.next_position = torch.minimum(self.next_position, lengths.to(self.next_position.device))

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only rows `rows`, in that order."""
        rows = rows.to(self.next_position.device)
        for store in (self.keys, self.values):
            for i, layer in enumerate(store):
                store[i] = layer[rows]
        self.next_position = self.next_position[rows]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window) -> torch.Tensor:
        """q [b, L, H, D], k and v [b, L, KV, D] -> [b, L, H D] for cache rows `rows` at their positions."""
        index, row_ids, positions, seen = window
        keys, values = self.keys[layer], self.values[layer]
        keys.transpose(1, 2)[row_ids[:, None], positions] = k  # [B, capacity, KV, D] view: row b's slots
        values.transpose(1, 2)[row_ids[:, None], positions] = v
        n_keys = seen.shape[-1]
        if self.alone:
            return self._attend_alone(q, keys[index], values[index], positions)
        b, L, H, D = q.shape
        KV = k.shape[2]
        group = H // KV
        # As the batch-1 runner lays them out (RollbackCache._attend): each KV head's query heads x L rows.
        q = q.reshape(b, L, KV, group, D).permute(0, 2, 3, 1, 4).reshape(b, KV, group * L, D)
        mask = seen[:, None].expand(b, group, L, n_keys).reshape(b, 1, group * L, n_keys)
        a = F.scaled_dot_product_attention(q, keys[index, :, :n_keys], values[index, :, :n_keys], attn_mask=mask)
        return a.view(b, KV, group, L, D).permute(0, 3, 1, 2, 4).reshape(b, L, H * D)

    def _attend_alone(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
        """Each query by itself over its row's slots 0..its position (padded: as a one-token batch-1 forward)."""
        b, L, H, D = q.shape
        out = []
        for i in range(b):
            for j, position in enumerate(positions[i].tolist()):
                n = position + 1
                mask = None  # "exact": as a batch-1 one-token forward attends where padding would not keep its bits
                if self.alone == "padded":
                    n_keys = min(padded_keys(n), keys.shape[2])
                    mask = (torch.arange(n_keys, device=q.device) < n)[None].expand(H // keys.shape[1], n_keys)
                else:
                    n_keys = n
                out.append(RollbackCache._attend(q[i, j : j + 1], keys[i, :, :n_keys], values[i, :, :n_keys], mask))
        return torch.cat(out).view(b, L, H * D)


def ragged_attention_matches_alone(core: LlamaCore, seed: int = 0) -> bool:
    """Whether every query of a ragged forward (rows of different lengths, blocks of a few tokens) gets the
    bits a one-token batch-1 forward gives it: RaggedCache's one SDPA call against RollbackCache._attend
    over the query's keys padded to KEY_BLOCK, on random keys (a few ms)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    H, KV, D = core.n_heads, core.n_kv, core.head_dim
    lengths, width = torch.tensor([60, 3, 130, 200]), 5  # blocks ending inside a KEY_BLOCK and across one
    cache = RaggedCache(core, padded=True)
    cache.reserve(len(lengths), int(lengths.max()) + width)
    for store in (cache.keys, cache.values):
        store[0].copy_(torch.randn(store[0].shape, generator=gen).to(core.dtype))
    cache.next_position = lengths.to(core.device)
    keys, values = cache.keys[0].clone(), cache.values[0].clone()
    q, k, v = (torch.randn(shape, generator=gen).to(core.dtype).to(core.device)
               for shape in ((len(lengths), width, H, D), (len(lengths), width, KV, D), (len(lengths), width, KV, D)))
    positions, window = cache.feed(None, torch.full((len(lengths),), width), width)
    together = cache.attend(0, q, k, v, window)
    keys.transpose(1, 2)[torch.arange(len(lengths))[:, None], positions] = k
    values.transpose(1, 2)[torch.arange(len(lengths))[:, None], positions] = v
    alone = RaggedCache(core, alone="padded")._attend_alone(q, keys, values, positions)
    return torch.equal(together, alone)


class RaggedRunner:
    """Rows of different lengths over one `RaggedCache`. Logits are over the full vocabulary (a subset
    draft's through VocabSubset.full_logits). Rows are cache rows: `keep` renumbers them.

    hidden_layers: layers whose outputs each forward keeps (a feature draft reads them): `hidden_states`
    [b, L, len(hidden_layers), hidden] of the last forward, fed to cache rows `hidden_rows` from
    positions `hidden_from` [b] on."""

    def __init__(self, model, vocab_size: int, hidden_layers: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.subset = VocabSubset.of(model)
        head_rows = self.subset.head_rows if self.subset is not None else vocab_size
        # The layout of each weight's matmul per row count, timed as the batch-1 runner's are: a verification
        # feeds a few rows per request, where F.linear is slow on some CPUs (decode/runners/projection.py).
        self.core = LlamaCore(model, head_rows, Projection)
        tune_layouts(self.core.projections())
        self.device = self.core.device
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 10**9
        self.hidden_layers = tuple(hidden_layers)
        if any(not 0 <= i < len(self.core.layers) for i in self.hidden_layers):
            raise ValueError(f"hidden_layers {self.hidden_layers} outside the model's {len(self.core.layers)} layers")
        self.hidden_states: torch.Tensor | None = None
        self.hidden_rows = self.hidden_from = torch.zeros(0, dtype=torch.long)
        self.padded, self.alone = self._row_invariance()
        self.reset()

    def _row_invariance(self) -> tuple[bool, str | None]:
        """(padded, alone) of the cache: in bf16 on a CPU each row gets the bits LeanRunner's one-token forward
        gives it: its matmuls ROW_BLOCK rows at most (one where even that fails here), its attention as the
        batch-1 runner's (padded keys where that runner pads them), queries alone where one call differs."""
        if not (self.device.type == "cpu" and self.core.dtype == torch.bfloat16):
            return False, None
        if not rows_match_alone(self.core.projections(), ROW_BLOCK):
            for projection in self.core.projections():
                projection.row_block = 1
        if not padded_attention_is_row_invariant(RollbackCache(self.core, self.max_length)):
            return False, "exact"
        return (True, None) if ragged_attention_matches_alone(self.core) else (True, "padded")

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens each row holds."""
        return self.cache.next_position

    @torch.inference_mode()
    def reset(self) -> None:
        self.cache = RaggedCache(self.core, self.padded, self.alone)

    @torch.inference_mode()
    def add(self, texts: list[list[int]]) -> torch.Tensor:
        """New rows holding `texts` (may be empty); returns their row indices."""
        first = self.cache.rows
        self.cache.reserve(first + len(texts), 0)
        rows = torch.arange(first, first + len(texts), device=self.device)
        longest = max(map(len, texts))
        if longest:
            tokens = torch.zeros(len(texts), longest, dtype=torch.long)
            for i, text in enumerate(texts):
                tokens[i, : len(text)] = torch.tensor(text, dtype=torch.long)
            self.forward(tokens, torch.tensor([len(t) for t in texts]), rows, logits=False)
        return rows

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor | None = None,
                logits: bool = True) -> torch.Tensor | None:
        """Feed tokens [b, L] to cache rows `rows` (default all), row i's first counts[i] of them (the rest
        are padding, never attended). Returns fp32 logits [b, L, vocab_size] (rows of padding: garbage)."""
        cache = self.cache
        rows = None if rows is None else rows.to(self.device)
        tokens, counts = tokens.to(self.device), counts.to(self.device)
        if self.hidden_layers:  # which rows, from which positions, the kept states belong to
            fed = torch.arange(cache.rows, device=self.device) if rows is None else rows
            self.hidden_rows, self.hidden_from = fed, cache.next_position[fed].clone()
        positions, window = cache.feed(rows, counts, tokens.shape[1])
        ids = tokens if self.subset is None else self.subset.rows(tokens)
        x, kept = self.core.decoder_layers(ids, positions, cache, window, self.hidden_layers)
        if kept:
            self.hidden_states = torch.stack(kept, dim=2)
        if not logits:
            return None
        out = self.core.logits(self.core.norm(x))  # [b, L, head rows]
        return out if self.subset is None else self.subset.full_logits(out)

    @torch.inference_mode()
    def truncate(self, lengths: torch.Tensor) -> None:
        """Row i keeps its first lengths[i] tokens (the slots after them stop counting)."""
        self.cache.truncate(lengths)

    @torch.inference_mode()
    def keep(self, rows: torch.Tensor) -> None:
        """Keep only cache rows `rows`, in that order (finished rows stop costing compute). The last forward's
        hidden states are dropped: their row numbers no longer hold."""
        self.cache.keep(rows)
        self.hidden_states = None
