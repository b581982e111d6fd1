"""Both sides of a training step at the same positions: the draft's logits and the teacher's
target distributions.

  cached  top-K log-probs stored by generate-data; no target model at train time
  online  the frozen target runs on every batch (full vocabulary)

Both hand back a `TargetBatch` for the loss positions; `buckets` then puts draft and target on
one support (see distill/losses.py for how the mass outside the top-K or the subset is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.utils import extract_model_from_parallel

from decode.vocab import VocabSubset
from distill.factored_buckets import factored_topk_buckets
from distill.losses import full_vocab_buckets, subset_buckets, topk_buckets


@dataclass
class TargetBatch:
    topk_ids: torch.Tensor | None = None
    """[N, K] cached teacher: the target's top-K full-vocabulary ids."""
    topk_logp: torch.Tensor | None = None
    """[N, K] their log-probs at T = 1."""
    logits: torch.Tensor | None = None
    """[N, V_target] online teacher: raw target logits."""

    def finite(self) -> bool:
        """False on NaN or +inf (log-probs of -inf are legal zero probabilities)."""
        values = self.topk_logp if self.logits is None else self.logits
        if self.logits is not None:
            return bool(torch.isfinite(values).all())
        return bool((~torch.isnan(values) & (values < float("inf"))).all())

    def top1(self) -> torch.Tensor:
        """[N] the target's most likely full-vocabulary id."""
        return self.topk_ids[:, 0] if self.logits is None else self.logits.argmax(-1)


def forward_at(model, mask: torch.Tensor, **inputs):
    """`model(**inputs)` with its head run only at the `mask` positions [B, T]: the output's logits are
    [1, N, V], those positions in row-major order. A forward hook on the decoder stack hands the head
    their hidden states as one row, so the call still goes through the model's own forward (which DDP
    and DeepSpeed need). Rows differ in length and prompts are often longer than completions: on the
    demo's micro-batches of 8 the head (the draft's biggest matmul, the target's 49,152 columns) ran over
    2.6x the positions the loss reads when it started at the first completion position, and a training
    step of the demo's draft took 0.43 s where it takes 0.29 s now (2-core AVX2 EPYC)."""
    def gather(module, args, output):
        output.last_hidden_state = output.last_hidden_state[mask].unsqueeze(0)
        return output

    handle = extract_model_from_parallel(model).get_decoder().register_forward_hook(gather)
    try:
        return model(**inputs)
    finally:
        handle.remove()


def draft_logits(model, batch: dict, subset: VocabSubset | None) -> torch.Tensor:
    """Draft logits at the loss positions, fp32 [N, V_draft], whose softmax is the draft's training
    distribution (a spread_other subset draft's "other" row counted once per outside token:
    VocabSubset.bucket_logits), so every loss, cross-entropy included, trains what the decoder and the
    export use. With factored outside rows: the raw rows [N, N_rows + 1 + r], whose full-vocabulary
    distribution Teacher.buckets builds without materialising it. The head runs only at the loss
    positions."""
    logits = draft_row_logits(model, batch, subset)
    if subset is None or subset.factored:  # factored: the raw rows, which Teacher.buckets reads as such
        return logits
    return subset.bucket_logits(logits)


def draft_row_logits(model, batch: dict, subset: VocabSubset | None) -> torch.Tensor:
    """The draft's raw output rows at the loss positions, fp32 [N, V_draft] (a subset draft reads its rows
    of the input ids); the head runs only at those positions."""
    ids = batch["input_ids"] if subset is None else subset.rows(batch["input_ids"])
    out = forward_at(model, batch["loss_mask"], input_ids=ids, attention_mask=batch["attention_mask"])
    return out.logits[0].float()


class Teacher:
    def __init__(self, kind: str, subset: VocabSubset | None, target=None):
        self.kind = kind
        self.subset = subset
        """The draft's vocabulary subset (on the training device), or None for a full-vocabulary draft."""
        self.factored = subset is not None and subset.factored
        self.row_subset = subset if subset is not None and not self.factored else None
        """The subset whose rows draft_logits' columns are; None for a full-vocabulary draft (columns are token
        ids) and for factored outside rows (raw rows: `buckets` and `draft_top1` read them)."""
        self.target = target  # frozen, eval mode; online only
        if target is not None:
            target.requires_grad_(False)

    @torch.no_grad()
    def targets(self, batch: dict) -> TargetBatch:
        """The target distributions at the batch's loss positions (N of them, row-major order)."""
        mask = batch["loss_mask"]
        if self.kind == "cached":
            return TargetBatch(topk_ids=batch["topk_ids"][mask], topk_logp=batch["topk_logp"][mask])
        logits = forward_at(self.target, mask, input_ids=batch["input_ids"],
                            attention_mask=batch["attention_mask"]).logits[0]  # [N, V_target]
        return TargetBatch(logits=logits.float())

    def buckets(self, draft_logits: torch.Tensor, target: TargetBatch):
        """(draft_logp, target_logp) on a common support, both [N, B]."""
        if self.factored:  # over the full vocabulary, which the draft covers
            if target.logits is None:
                return factored_topk_buckets(draft_logits, self.subset.outside_factors,
                                             self.subset.full_columns[target.topk_ids], target.topk_logp,
                                             self.subset.size)
            return full_vocab_buckets(self.subset.full_logits(draft_logits), target.logits)
        if target.logits is None:
            rows = target.topk_ids if self.row_subset is None else self.row_subset.output_rows[target.topk_ids]
            # A full-vocabulary draft narrower than the target's padded vocabulary cannot emit those ids.
            rows = torch.where(rows < draft_logits.shape[-1], rows, -1)
            return topk_buckets(draft_logits, rows, target.topk_logp)
        if self.row_subset is None:
            return full_vocab_buckets(draft_logits, target.logits)
        return subset_buckets(draft_logits, target.logits, self.row_subset.ids)

    @property
    def spread_other(self) -> bool:
        """Whether draft_logits' last column is a spread "other" row, the logit of each outside token
        (decode/vocab.py)."""
        return self.row_subset is not None and self.row_subset.spread_other

    def decode_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The draft as the decoder uses it at T = 1: an old subset draft's "other" row never wins or
        gets mass; a spread draft's stands for the outside tokens, as in training."""
        if self.row_subset is None or self.spread_other:
            return draft_logits
        return torch.cat([draft_logits[:, :-1], torch.full_like(draft_logits[:, -1:], float("-inf"))], -1)

    def draft_top1(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N] the draft's greedy choice as a full-vocabulary id. A spread draft's "other" row competes
        with one outside token's logit (argmax sees ties, not their total), so its count comes off."""
        if self.factored:
            return self.subset.full_logits(draft_logits).argmax(-1)
        logits = self.decode_logits(draft_logits)
        if self.spread_other:
            logits = logits.clone()
            logits[:, -1] -= self.row_subset.other_log_count
        rows = logits.argmax(-1)
        return rows if self.row_subset is None else self.row_subset.token_ids(rows)
