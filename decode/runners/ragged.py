"""The lean Llama forward over many rows that each keep their own length: batched speculative decoding.

Rows accept different numbers of drafted tokens, so their committed texts grow unevenly. This cache
does not move anything to keep rows aligned: every forward writes its L tokens per row into the same
new slots (length..length+L-1), and a validity mask [B, capacity] says which slots hold a row's text.
Rolling a row back (`truncate`) only clears its mask bits; a row fed fewer than L tokens marks the
rest invalid; a row joining later (`add`) fills fresh slots while the others' stay invalid. Each row's
token keeps the rotary position of its place in that row's text, so attention over the valid slots
is exactly the batch-1 forward of that row (tests compare them).

Slots are used up by every forward whatever is kept (~k + 1 per verified block, and every joining
row's prompt), so when the cache is full `compact` first moves each row's valid slots to the front
(attention does not care where a key sits: its position was applied when it was written), and the
cache grows in CACHE_CHUNK steps only when the rows' texts themselves need it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from decode.runners.lean import CACHE_CHUNK
from decode.runners.llama import LlamaCore
from decode.runners.projection import Projection, tune_layouts
from decode.vocab import VocabSubset


class RaggedCache:
    """Keys and values [B, KV, capacity, D] per layer; valid [B, capacity]; next_position [B]."""

    def __init__(self, core: LlamaCore):
        self.core = core
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=core.device)
        self.next_position = torch.zeros(0, dtype=torch.long, device=core.device)
        self.length = 0  # slots used (valid or not)
        self.rope = core.rope_table(CACHE_CHUNK)

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    def reserve(self, rows: int, slots: int) -> int:
        """Room for `rows` rows (new ones empty) and `slots` more slots after the used ones, keeping what is
        cached (compacted when that makes the room). Returns the first free slot."""
        c = self.core
        capacity = self.valid.shape[1]
        if self.length + slots > capacity and self.rows:
            self.compact()
        slots += self.length
        if rows <= self.rows and slots <= capacity:
            return self.length
        capacity = max(capacity, -(-slots // CACHE_CHUNK) * CACHE_CHUNK)
        shape = (rows, c.n_kv, capacity, c.head_dim)
        for store in (self.keys, self.values):
            for i in range(len(c.layers)):
                grown = torch.zeros(shape, dtype=c.dtype, device=c.device)
                if i < len(store):
                    old = store[i]
                    grown[: old.shape[0], :, : self.length] = old[:, :, : self.length]
                    store[i] = grown
                else:
                    store.append(grown)
        valid = torch.zeros(rows, capacity, dtype=torch.bool, device=c.device)
        valid[: self.rows, : self.length] = self.valid[:, : self.length]
        self.valid = valid
        self.next_position = F.pad(self.next_position, (0, rows - self.next_position.shape[0]))
        if capacity > self.rope.cos.shape[0]:
            self.rope = c.rope_table(capacity)
        return self.length

    def compact(self) -> None:
        """Move each row's valid slots, in order, to slots 0..count-1."""
        count = self.valid.sum(-1)  # [B]
        length = int(count.max())
        # Row b's valid slots first (a stable sort keeps their order), then its others.
        order = torch.sort((~self.valid[:, : self.length]).to(torch.int8), dim=-1, stable=True).indices[:, :length]
        for store in (self.keys, self.values):
            for i, layer in enumerate(store):
                index = order[:, None, :, None].expand(-1, layer.shape[1], -1, layer.shape[3])
                store[i][:, :, :length] = layer.gather(2, index)
        self.valid = torch.zeros_like(self.valid)
        self.valid[:, :length] = torch.arange(length, device=count.device)[None, :] < count[:, None]
        self.length = length

    def feed(self, rows: torch.Tensor | None, counts: torch.Tensor, width: int) -> tuple[torch.Tensor, tuple]:
        """Slots for a forward of `width` tokens per row to cache rows `rows` (None: every row, in order),
        row i's first counts[i] real (the rest padding, never attended). Returns the tokens' rotary positions
        [b, width] and the window `attend` takes, and advances the rows past their real tokens."""
        device = self.valid.device
        slot0 = self.reserve(self.rows, width)
        # Every row: a slice, so attention reads and writes the cache in place instead of gathering copies.
        index = slice(None) if rows is None else rows
        new = torch.arange(width, device=device)[None, :] < counts[:, None]  # [b, width] real tokens
        positions = self.next_position[index, None] + torch.arange(width, device=device)  # [b, width]
        self.valid[index, slot0 : slot0 + width] = new
        # Query i of row r attends the row's valid slots up to its own; a padding query attends itself only.
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        seen = self.valid[index, None, : slot0 + width].expand(len(new), width, slot0 + width).clone()  # [b, L, S]
        seen[:, :, slot0:] &= causal
        seen[:, torch.arange(width), slot0 + torch.arange(width)] |= ~new
        self.next_position[index] += counts
        self.length = slot0 + width
        return positions, (index, slot0, seen[:, None])

    def truncate(self, lengths: torch.Tensor) -> None:
        """Row i keeps its first lengths[i] tokens (the slots after them stop counting)."""
        lengths = lengths.to(self.valid.device)
        self.valid &= self.valid.cumsum(-1) <= lengths[:, None]
        self.next_position = torch.minimum(self.next_position, lengths)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only rows `rows`, in that order."""
        rows = rows.to(self.valid.device)
        for store in (self.keys, self.values):
            for i, layer in enumerate(store):
                store[i] = layer[rows]
        self.valid, self.next_position = self.valid[rows], self.next_position[rows]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window) -> torch.Tensor:
        """q [b, L, H, D], k and v [b, L, KV, D] -> [b, L, H D] for cache rows `rows` at slots slot0.."""
        rows, slot0, mask = window
        b, L, H, D = q.shape
        end = slot0 + L
        self.keys[layer][rows, :, slot0:end] = k.transpose(1, 2)
        self.values[layer][rows, :, slot0:end] = v.transpose(1, 2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), self.keys[layer][rows, :, :end],
                                           self.values[layer][rows, :, :end], attn_mask=mask,
                                           enable_gqa=H != k.shape[2])  # [b, H, L, D]
        return a.transpose(1, 2).reshape(b, L, H * D)


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
        self.reset()

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens each row holds."""
        return self.cache.next_position

    @torch.inference_mode()
    def reset(self) -> None:
        self.cache = RaggedCache(self.core)

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
