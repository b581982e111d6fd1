"""The feature draft at batch > 1: what decode/batched_speculative.py's `serve` asks of a draft runner
(add, forward, lengths, truncate, keep), drafting from the hidden states of the target's RaggedRunner.

As at batch 1 (decode/drafts/feature/proposer.py), draft position i reads a hidden state and the target's
embedding of token i + 1 and predicts token i + 2: reading token j is running position j - 1, so a
row's first token has no position (its length counts it) and the output after reading token j predicts
token j + 1, as a standalone draft's would. Position i's hidden state is `fc` of the target's hidden
states at i where the target has verified i, else the draft's own output at i - 1 (a guess's position).

The target runner is read right after its forwards: `add` after the target's `add` of the same texts,
`truncate` after the target's verification and truncation. The verified states a row has not read yet
wait in `pending`; `truncate` also drops the positions built from the draft's own outputs, so the
next forward rebuilds them from the target's states. Invariant per row, between rounds: positions read
from the target's states + pending == the target's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode.drafts.feature.model import FeatureDraft
from decode.runners.llama import RotaryTable
from decode.runners.ragged import RaggedCache, RaggedRunner


@dataclass
class _CacheShape:
    """What RaggedCache reads of a model: the feature draft's one attention layer."""
    n_kv: int
    head_dim: int
    layers: tuple
    dtype: torch.dtype
    device: torch.device
    draft: FeatureDraft

    def rope_table(self, capacity: int) -> RotaryTable:
        return self.draft.rope(capacity)


class RaggedFeatureDrafter:
    """Feature drafting for many rows of different lengths, over one single-layer RaggedCache. Logits are
    over the target's full vocabulary (-inf outside the draft's head rows). `target_embeddings` [V, hidden]:
    the target's input embedding matrix."""

    follows_lookup = False
    """Past the verified text a row reads one guess per forward (its hidden state is the draft's output at the
    guess before), so it cannot read a run of looked-up guesses at once (batched_speculative.serve)."""

    def __init__(self, target: RaggedRunner, draft: FeatureDraft, target_embeddings: torch.Tensor):
        if target.hidden_layers != tuple(draft.config.target_layers):
            raise ValueError(f"the target runner keeps the hidden states of layers {list(target.hidden_layers)}, the "
                             f"feature draft reads layers {list(draft.config.target_layers)}: build it with "
                             "hidden_layers=draft.config.target_layers")
        self.target, self.draft, self.embeddings = target, draft, target_embeddings
        weight = draft.fc.weight
        c = draft.config
        self.shape = _CacheShape(c.num_key_value_heads, c.head_dim, (None,), weight.dtype, weight.device, draft)
        self.vocab_size = target.vocab_size
        self.reset()

    def reset(self) -> None:
        self.cache = RaggedCache(self.shape)
        self.tokens = torch.zeros(0, dtype=torch.long)  # [B] tokens read (positions + 1; 0: none yet)
        self.verified = torch.zeros(0, dtype=torch.long)  # [B] positions built from the target's states
        self.pending: list[torch.Tensor] = []  # per row: fused target states [m, hidden] of the next positions
        self.last_out: list[torch.Tensor | None] = []  # per row: the output at its last position

    @property
    def lengths(self) -> torch.Tensor:
        """[B] tokens each row has read."""
        return self.tokens

    @torch.inference_mode()
    def add(self, texts: list[list[int]]) -> torch.Tensor:
        """New rows reading `texts`, which the target's last forward (its `add`) has just read."""
        first = len(self.pending)
        self.cache.reserve(first + len(texts), 0)
        self.tokens = torch.cat([self.tokens, torch.zeros(len(texts), dtype=torch.long)])
        self.verified = torch.cat([self.verified, torch.zeros(len(texts), dtype=torch.long)])
        width = self.draft.config.hidden_size
        self.pending += [torch.zeros(0, width, dtype=self.shape.dtype, device=self.shape.device) for _ in texts]
        self.last_out += [None] * len(texts)
        rows = torch.arange(first, first + len(texts))
        self._read_target()
        longest = max(map(len, texts))
        if longest:
            tokens = torch.zeros(len(texts), longest, dtype=torch.long)
            for i, text in enumerate(texts):
                tokens[i, : len(text)] = torch.tensor(text, dtype=torch.long)
            self.forward(tokens, torch.tensor([len(t) for t in texts]), rows, logits=False)
        return rows

    def _read_target(self) -> None:
        """Queue, per row the target's last forward fed, the states of the positions it now holds as verified."""
        target = self.target
        if target.hidden_states is None:
            return
        fused = self.draft.fuse(target.hidden_states)  # [b, L, hidden]
        for i, (row, start) in enumerate(zip(target.hidden_rows.tolist(), target.hidden_from.tolist())):
            held = int(self.verified[row]) + self.pending[row].shape[0]
            if held < start:
                raise RuntimeError(f"row {row}: the target verified positions {held}..{start - 1} unseen by the draft")
            if held == start:  # held > start: that forward was read already
                self.pending[row] = torch.cat([self.pending[row], fused[i, : int(target.lengths[row]) - start]])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor | None = None,
                logits: bool = True) -> torch.Tensor | None:
        """Read tokens [b, L], row i's first counts[i] of them. Returns fp32 logits [b, L, vocab]: at each
        read token, the draft's prediction of the next one (a row's first token, which has no position:
        0 over the head rows); None with logits=False (a prompt read on joining: [b, L, vocab] of them would
        be ~3 GB for 64 prompts of 256 tokens over SmolLM2's 49,152 tokens)."""
        every_row, rows = rows is None, torch.arange(len(self.pending)) if rows is None else rows
        b, width = tokens.shape
        positions_fed = counts - ((self.tokens[rows] == 0) & (counts > 0)).long()  # a row's first token has none
        hidden = torch.zeros(b, width, self.draft.config.hidden_size, dtype=self.shape.dtype, device=self.shape.device)
        embed_ids = torch.zeros(b, width, dtype=torch.long)
        for i, row in enumerate(rows.tolist()):
            n = int(positions_fed[i])
            if n <= 0:
                continue
            start = int(counts[i]) - n
            embed_ids[i, :n] = tokens[i, start : start + n]
            hidden[i, :n] = self._hidden_for(row, n)
        device = self.shape.device  # bookkeeping stays on the host; the cache is where the draft is
        positions, window = self.cache.feed(None if every_row else rows.to(device), positions_fed.to(device), width)
        cos, sin = self.cache.rope.at(positions)
        embeds = self.embeddings[embed_ids.to(self.embeddings.device)].to(self.shape.dtype)
        q, k, v = self.draft.qkv(hidden, embeds, cos, sin)
        out = self.draft.finish(hidden, self.cache.attend(0, q, k, v, window))  # [b, width, hidden]
        for i, row in enumerate(rows.tolist()):
            if int(positions_fed[i]) > 0:
                self.last_out[row] = out[i, int(positions_fed[i]) - 1]
        self.tokens[rows] += counts
        if not logits:
            return None
        # Align each row's outputs with its tokens: token start + t is read at position slot t.
        aligned = torch.zeros_like(out)
        for i in range(b):
            n, start = int(positions_fed[i]), int(counts[i] - positions_fed[i])
            if n > 0:
                aligned[i, start : start + n] = out[i, :n]
        return self._full_logits(self.draft.logits(aligned))

    def _hidden_for(self, row: int, n: int) -> torch.Tensor:
        """The hidden states [n, hidden] of row `row`'s next n positions: the target's pending states,
        or for a single position past them, the draft's own last output (zeros where it has none)."""
        pending = self.pending[row]
        if pending.shape[0] >= n:
            self.pending[row] = pending[n:]
            self.verified[row] += n
            return pending[:n]
        if pending.shape[0] == 0 and n == 1:
            last = self.last_out[row]  # None: a one-token prompt's first guess, before the target read anything
            return last[None] if last is not None else pending.new_zeros(1, pending.shape[1])
        raise ValueError(f"row {row}: {n} positions to read, {pending.shape[0]} target states pending: a guess is read "
                         "one at a time after the verified text")

    def _full_logits(self, row_logits: torch.Tensor) -> torch.Tensor:
        full = row_logits.new_full((*row_logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft.draft_ids] = row_logits
        return full

    @torch.inference_mode()
    def truncate(self, lengths: torch.Tensor) -> None:
        """Row i keeps at most lengths[i] tokens, and no position built from the draft's own outputs: it reads
        the target's verification first."""
        self._read_target()
        from_target = torch.where(self.verified > 0, self.verified + 1, self.tokens.clamp(max=1))  # tokens
        kept = torch.minimum(lengths.cpu(), from_target)
        if (kept < from_target).any():
            raise ValueError("a feature draft keeps the text the target verified: it cannot roll back into it")
        self.cache.truncate((kept - 1).clamp(min=0))
        for row in (kept < self.tokens).nonzero()[:, 0].tolist():
            self.last_out[row] = None
        self.tokens = kept

    @torch.inference_mode()
    def keep(self, rows: torch.Tensor) -> None:
        """Keep only rows `rows`, in that order."""
        self.cache.keep(rows)
        self.tokens, self.verified = self.tokens[rows], self.verified[rows]
        self.pending = [self.pending[r] for r in rows.tolist()]
        self.last_out = [self.last_out[r] for r in rows.tolist()]
