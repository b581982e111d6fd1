"""The vocabulary subset of a draft: the one place that knows how draft rows map to token ids.

A subset draft has an embedding and a tied head of N + 1 rows: row i stands for full-vocabulary
token `ids[i]`, and row N ("other") stands on input for every token outside the subset. Its output
logit is only used in training (the mass outside the subset); the decoder gives the draft
probability 0 outside the subset, which keeps the acceptance rule exact.

On disk the subset travels in the draft's HF config as two attributes, written and read only here:
  draft_vocab_ids  [N] full-vocabulary id of each row
  full_vocab_size  the target's vocabulary size
Training (distill/), decoding (runners, proposers), the HF baseline and export all use this type.
"""

from __future__ import annotations

import torch

IDS_ATTR = "draft_vocab_ids"
FULL_SIZE_ATTR = "full_vocab_size"


class VocabSubset:
    """Full-vocabulary ids <-> draft rows."""

    def __init__(self, ids, full_vocab_size: int, device: torch.device | str = "cpu"):
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=device)  # [N] full id of row i
        if self.ids.dim() != 1 or self.ids.numel() == 0:
            raise ValueError("a vocabulary subset needs a non-empty 1-D list of token ids")
        if int(self.ids.min()) < 0 or int(self.ids.max()) >= full_vocab_size:
            raise ValueError(f"vocabulary subset ids must lie in [0, {full_vocab_size})")
        self.full_vocab_size = int(full_vocab_size)
        self.other_row = self.ids.numel()
        # Input side: full id -> row; every id outside the subset -> the "other" row N.
        self.input_rows = torch.full((full_vocab_size,), self.other_row, dtype=torch.long, device=device)
        self.input_rows[self.ids] = torch.arange(self.other_row, device=device)
        # Output side: full id -> row, -1 where the draft cannot emit the token.
        self.output_rows = torch.where(self.input_rows == self.other_row, -1, self.input_rows)

    @property
    def size(self) -> int:
        """N: the tokens the draft can emit (its "other" row not counted)."""
        return self.other_row

    @property
    def device(self) -> torch.device:
        return self.ids.device

    def to(self, device) -> VocabSubset:
        return self if torch.device(device) == self.device else VocabSubset(self.ids, self.full_vocab_size, device)

    # ------------------------------------------------------------------ the HF config contract
    @classmethod
    def from_config(cls, config, device: torch.device | str = "cpu") -> VocabSubset | None:
        """The subset recorded in a draft's HF config, or None for a full-vocabulary model."""
        ids = getattr(config, IDS_ATTR, None)
        if not ids:
            return None
        return cls(list(ids), int(getattr(config, FULL_SIZE_ATTR)), device)

    @classmethod
    def of(cls, model, device: torch.device | str | None = None) -> VocabSubset | None:
        if device is None:
            device = next(model.parameters()).device
        return cls.from_config(model.config, device)

    def write_to(self, config) -> None:
        """Record this subset in an HF config (saved with the draft's weights)."""
        setattr(config, IDS_ATTR, self.ids.tolist())
        setattr(config, FULL_SIZE_ATTR, self.full_vocab_size)

    # ------------------------------------------------------------------ ids <-> rows
    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of full-vocabulary ids (ids outside the subset -> the "other" row)."""
        return self.input_rows[token_ids]

    def token_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ids of emitted rows (never the "other" row)."""
        return self.ids[rows]

    def spread(self, row_values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """Values over the N token rows [..., N(+1)] -> [..., full_vocab_size], `fill` outside the subset
        (logits: -inf, probabilities: 0). A trailing "other" column is dropped."""
        values = row_values[..., : self.size]
        full = values.new_full((*values.shape[:-1], self.full_vocab_size), fill)
        full[..., self.ids] = values
        return full


def model_vocab_size(model: torch.nn.Module) -> int:
    """Size of the full vocabulary a model speaks (a subset draft speaks the full one through its subset)."""
    subset = VocabSubset.from_config(model.config)
    if subset is not None:
        return subset.full_vocab_size
    return int(model.get_output_embeddings().weight.shape[0])
