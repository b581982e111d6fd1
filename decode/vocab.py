"""The vocabulary subset of a draft: the one place that knows how draft rows map to token ids.

A subset draft has an embedding and a tied head of N + 1 rows: row i stands for full-vocabulary
token `ids[i]`, and row N ("other") stands on input for every token outside the subset. Its output
logit means one of two things, recorded per draft:
  spread_other  (new drafts) the logit of EACH of the V - N tokens outside the subset: training counts
                it V - N times in the softmax (+ log(V - N)), the decoder puts it at every outside id.
                Copying the other row to every outside row then gives a plain full-vocabulary model
                with exactly this distribution (distill/export/hf_full.py), which serving engines load.
  otherwise     (drafts trained before) the mass outside the subset, used only in training; the
                decoder gives the draft probability 0 outside the subset.
Either way the decoder samples from, and the acceptance rule sees, the same distribution.

Factored outside rows (distill.outside_rank = r > 0, spread drafts only): the outside tokens get logits of
their own at low-rank cost. The head holds r more rows after "other" (a basis P [r, hidden]: their logits
are z = P h) and the draft a parameter `outside_factors` U [V - N, r], one row per outside id in ascending
order; outside token j's logit is other + U_j . z, i.e. its head row is w_other + U_j P. U = 0 is exactly a
spread draft. The distribution is over the full vocabulary (training compares it with the target's there),
and materialising w_other + U P as head rows gives a plain full-vocabulary model with exactly it
(distill/export/hf_full.py). On input, outside tokens still read the "other" row.

On disk the subset travels in the draft's HF config as three attributes, written and read only here:
  draft_vocab_ids     [N] full-vocabulary id of each row
  full_vocab_size     the target's vocabulary size
  draft_spread_other  True for a spread_other draft (absent: False)
  draft_outside_rank  r of factored outside rows (absent: 0); U itself is saved beside the weights in
                      outside_factors.safetensors (OUTSIDE_FILE), so HF tools reading the folder see a plain model
Training (distill/), decoding (runners, proposers), the HF baseline and export all use this type.
"""

from __future__ import annotations

import math

import torch

from common.outside_factors import FACTORS_NAME, RANK_ATTR


IDS_ATTR = "draft_vocab_ids"
FULL_SIZE_ATTR = "full_vocab_size"
SPREAD_ATTR = "draft_spread_other"
# RANK_ATTR, FACTORS_NAME and where U is saved: common/outside_factors.py (load_model attaches it).


class VocabSubset:
    """Full-vocabulary ids <-> draft rows."""

    def __init__(self, ids, full_vocab_size: int, device: torch.device | str = "cpu", spread_other: bool = False,
                 outside_rank: int = 0, outside_factors: torch.Tensor | None = None):
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=device)  # [N] full id of row i
        if self.ids.dim() != 1 or self.ids.numel() == 0:
            raise ValueError("a vocabulary subset needs a non-empty 1-D list of token ids")
        if int(self.ids.min()) < 0 or int(self.ids.max()) >= full_vocab_size:
            raise ValueError(f"vocabulary subset ids must lie in [0, {full_vocab_size})")
        self.full_vocab_size = int(full_vocab_size)
        self.spread_other = bool(spread_other)
        if self.spread_other and self.ids.numel() >= full_vocab_size:
            raise ValueError("a spread \"other\" row needs tokens outside the subset to stand for")
        self.other_row = self.ids.numel()
        # Input side: full id -> row; every id outside the subset -> the "other" row N.
        self.input_rows = torch.full((full_vocab_size,), self.other_row, dtype=torch.long, device=device)
        self.input_rows[self.ids] = torch.arange(self.other_row, device=device)
        # Output side: full id -> row, -1 where the draft cannot emit the token.
        self.output_rows = torch.where(self.input_rows == self.other_row, -1, self.input_rows)
        # Row -> full id of what a full-vocabulary argmax emits: a spread draft's "other" row ties at
        # every outside id, and argmax takes the first (an old draft's never wins: no entry).
        self.outside_ids = (self.output_rows < 0).nonzero()[:, 0]  # [V - N] ascending
        self.emitted_ids = torch.cat([self.ids, self.outside_ids[:1]]) if self.spread_other else self.ids
        self.outside_rank = int(outside_rank)
        if self.outside_rank < 0 or (self.outside_rank and not self.spread_other):
            raise ValueError("factored outside rows need a spread \"other\" row and a rank >= 1")
        self.outside_factors = outside_factors
        """U [V - N, r]: the draft's own parameter (not a copy), so training's gradients reach it through
        full_logits; None until a model supplies it (from_config alone cannot)."""
        if outside_factors is not None and tuple(outside_factors.shape) != (len(self.outside_ids), self.outside_rank):
            raise ValueError(f"outside factors of shape {tuple(outside_factors.shape)}; this subset needs "
                             f"({len(self.outside_ids)}, {self.outside_rank})")
        # Full id -> column of cat([the N token rows' logits, the V - N outside logits]).
        self.full_columns = self.input_rows.clone()
        self.full_columns[self.outside_ids] = self.other_row + torch.arange(len(self.outside_ids), device=device)

    @property
    def size(self) -> int:
        """N: the tokens the draft can emit (its "other" row not counted)."""
        return self.other_row

    @property
    def factored(self) -> bool:
        """Whether the outside tokens have factored logits of their own (outside_rank > 0)."""
        return self.outside_rank > 0

    @property
    def head_rows(self) -> int:
        """Output rows the decoder scores: the N token rows, a spread draft's "other" row and the r basis rows
        of factored outside rows."""
        return self.size + int(self.spread_other) + self.outside_rank

    @property
    def outside_params(self) -> int:
        """Parameters the factored outside rows add beyond the head's rows: U's (V - N) x r."""
        return len(self.outside_ids) * self.outside_rank

    @property
    def other_log_count(self) -> float:
        """What a spread draft's "other" logit gains in a softmax over its rows: log(V - N), as it is
        the logit of each of the V - N outside tokens. 0 otherwise: an old draft's "other" row is the
        outside mass itself."""
        return math.log(self.full_vocab_size - self.size) if self.spread_other else 0.0

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def to(self, device) -> VocabSubset:
        if torch.device(device) == self.device:
            return self
        return VocabSubset(self.ids, self.full_vocab_size, device, self.spread_other, self.outside_rank,
                           self.outside_factors)

    # ------------------------------------------------------------------ the HF config contract
    @classmethod
    def from_config(cls, config, device: torch.device | str = "cpu") -> VocabSubset | None:
        """The subset recorded in a draft's HF config, or None for a full-vocabulary model."""
        ids = getattr(config, IDS_ATTR, None)
        if not ids:
            return None
        # Drafts written before the flag existed were trained with the "other" row as the outside mass.
        return cls(list(ids), int(getattr(config, FULL_SIZE_ATTR)), device, bool(getattr(config, SPREAD_ATTR, False)),
                   int(getattr(config, RANK_ATTR, 0)))

    @classmethod
    def of(cls, model, device: torch.device | str | None = None) -> VocabSubset | None:
        """The subset of a draft model, its outside factors included (the model's parameter itself)."""
        if device is None:
            device = next(model.parameters()).device
        subset = cls.from_config(model.config, device)
        if subset is not None and subset.factored:
            factors = getattr(model, FACTORS_NAME, None)
            if factors is None:
                raise ValueError(f"the draft's config names {subset.outside_rank} factored outside rows but the model "
                                 f"has no {FACTORS_NAME}: load it with common.models.load_model")
            subset = cls(subset.ids, subset.full_vocab_size, device, True, subset.outside_rank, factors)
        return subset

    def write_to(self, config) -> None:
        """Record this subset in an HF config (saved with the draft's weights)."""
        setattr(config, IDS_ATTR, self.ids.tolist())
        setattr(config, FULL_SIZE_ATTR, self.full_vocab_size)
        setattr(config, SPREAD_ATTR, self.spread_other)
        if self.factored:
            setattr(config, RANK_ATTR, self.outside_rank)

    @staticmethod
    def remove_from(config) -> None:
        """Erase any subset from an HF config (a draft exported with the full vocabulary's rows)."""
        for attr in (IDS_ATTR, FULL_SIZE_ATTR, SPREAD_ATTR, RANK_ATTR):
            if hasattr(config, attr):
                delattr(config, attr)

    def bucket_logits(self, row_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the rows [..., N + 1] whose softmax is the draft's distribution over [its N tokens,
        everything outside the subset] (what training compares with the target): a spread draft's
        "other" logit counted V - N times, an old draft's as it is."""
        if not self.spread_other:
            return row_logits
        offset = torch.zeros(row_logits.shape[-1], dtype=row_logits.dtype, device=row_logits.device)
        offset[self.other_row] = self.other_log_count
        return row_logits + offset

    # ------------------------------------------------------------------ ids <-> rows
    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of full-vocabulary ids (ids outside the subset -> the "other" row)."""
        return self.input_rows[token_ids]

    def token_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ids of emitted rows (a spread draft's "other" row: the first outside id,
        where a full-vocabulary argmax lands; an old draft never emits it)."""
        return self.emitted_ids[rows]

    def full_logits(self, row_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the rows [..., N(+1)(+r)] -> [..., full_vocab_size]: a spread draft's "other" logit
        at every id outside the subset (plus U_j . z with factored outside rows), else -inf there
        (probability 0). An old draft's trailing "other" column is dropped. Differentiable."""
        values = row_logits[..., : self.size]
        if self.factored:
            if self.outside_factors is None:
                raise ValueError("factored outside rows without their factors: use VocabSubset.of(model)")
            basis = row_logits[..., self.other_row + 1: self.head_rows]  # z = P h [..., r]
            outside = row_logits[..., self.other_row:self.other_row + 1] + basis @ self.outside_factors.to(
                basis.dtype).T  # [..., V - N]
            return torch.cat([values, outside], -1)[..., self.full_columns]
        if self.spread_other:
            full = row_logits[..., self.size:self.size + 1].expand(*values.shape[:-1], self.full_vocab_size).clone()
        else:
            full = values.new_full((*values.shape[:-1], self.full_vocab_size), float("-inf"))
        full[..., self.ids] = values
        return full


def model_vocab_size(model: torch.nn.Module) -> int:
    """Size of the full vocabulary a model speaks (a subset draft speaks the full one through its subset)."""
    subset = VocabSubset.from_config(model.config)
    if subset is not None:
        return subset.full_vocab_size
    return int(model.get_output_embeddings().weight.shape[0])
