"""The stored teacher of a feature draft (distill.teacher=stored): FeatureTeacher's FeatureBatch without
running the target.

  hidden       the hidden states `make features` stored (distill/feature_store.py), cut to the example's
               window: Example.origin names the shard row and where the kept tokens start in it
  embeds       the target's embedding of each next token: a lookup in its embedding matrix
  target_logp  from the shard's stored top-K (T = 1 log-probs of the distribution that predicted each
               completion token): the top-K entries exact, every other subset token log(rest / (V - K)),
               rest = 1 - Σ exp(top-K) floored as the cached teacher's (distill/losses.py)
  target_top1  the top-K's first id

A prompt that make_example shortened (its oldest tokens dropped) keeps the stored states of the whole
prompt, as the stored top-K did: the online teacher would see only the kept window. Held-out metrics
run the target on the held-out rows (distill/training/feature.py), so α stays exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open

from distill.data import DataError, Example
from distill.feature_store import FeatureSpec, check_folder, features_dir, features_file, is_current, shard_digests
from distill.training.feature_teacher import FeatureBatch

REST_FLOOR = 1e-6  # the cached teacher's floor on the mass outside the top-K (distill/losses.py)


class StoredFeatures:
    """The hidden states stored for every shard of distill.data_dirs, all checked when opened (before any
    training step) against the run's target, layers and shards."""

    def __init__(self, data_dirs: list[str], spec: FeatureSpec):
        self.spec = spec
        self.files = {}
        for data_dir in data_dirs:
            if not check_folder(data_dir, spec):
                raise DataError(f"distill.teacher=stored: {data_dir} has no stored features "
                                f"({features_dir(data_dir)} lacks features.json); run `make features` with this "
                                f"config first")
            for shard, digest in shard_digests(data_dir).items():
                if not is_current(shard, digest):
                    raise DataError(f"distill.teacher=stored: {features_file(shard)} is missing or was made from "
                                    f"another version of {shard}; run `make features` with this config")
                self.files[shard] = safe_open(features_file(shard), framework="pt")
        self.offsets = {shard: f.get_tensor("offsets") for shard, f in self.files.items()}  # [rows + 1] each

    def batch(self, examples: list[Example], shape: torch.Size) -> torch.Tensor:
        """[B, T, L, H] bf16 for a collated batch of `shape` [B, T]: each example's input positions (all its
        tokens but the last, as collate's input_ids), zeros on padding and on a dummy row."""
        hidden = torch.zeros((*shape, len(self.spec.layers), self.spec.identity["hidden_size"]),
                             dtype=torch.bfloat16)
        for b, example in enumerate(examples):
            shard, row, start = example.origin
            first = int(self.offsets[shard][row]) + start
            n = len(example.ids) - 1
            hidden[b, :n] = self.files[shard].get_slice("hidden")[first:first + n]
        return hidden


def topk_subset_logp(topk_ids: torch.Tensor, topk_logp: torch.Tensor, subset_ids: torch.Tensor,
                     vocab_size: int) -> torch.Tensor:
    """[n, N] log-probs of the subset's tokens from a stored top-K (topk_ids / topk_logp [n, K]): the top-K's
    exact, the others log(rest / (V - K))."""
    n, k = topk_ids.shape
    rest = (1 - topk_logp.exp().sum(-1)).clamp(min=REST_FLOOR)  # [n]
    fill = torch.log(rest / max(vocab_size - k, 1))
    target_logp = fill[:, None].repeat(1, subset_ids.shape[0])  # [n, N]
    row_of = torch.full((vocab_size,), -1, dtype=torch.long, device=topk_ids.device)
    row_of[subset_ids] = torch.arange(subset_ids.shape[0], device=topk_ids.device)
    rows = row_of[topk_ids]  # [n, K]: each top-K token's subset row, -1 outside the subset
    inside = rows >= 0
    positions = torch.arange(n, device=topk_ids.device)[:, None].expand(n, k)
    target_logp[positions[inside], rows[inside]] = topk_logp[inside]
    return target_logp


class StoredFeatureTeacher:
    def __init__(self, embedding: torch.Tensor, subset_ids: torch.Tensor, dtype: torch.dtype):
        self.embedding = embedding  # [V, H] the target's input embeddings, on the training device
        self.subset_ids = subset_ids  # [N] on the same device
        self.dtype = dtype  # the draft's

    @torch.no_grad()
    def __call__(self, batch: dict) -> FeatureBatch:
        """batch: collate's with the top-K, plus stored_hidden [B, T, L, H] (StoredFeatures.batch)."""
        loss_mask = batch["loss_mask"]
        # The online teacher's alignment (feature_teacher.py): draft position i <- target position i + 1.
        positions = F.pad(loss_mask[:, 1:], (0, 1))  # [B, T]
        teacher_at = F.pad(loss_mask[:, 1:], (1, 0))  # [B, T]
        topk_ids, topk_logp = batch["topk_ids"][teacher_at], batch["topk_logp"][teacher_at].float()  # [n, K]
        target_logp = topk_subset_logp(topk_ids, topk_logp, self.subset_ids, self.embedding.shape[0])
        embeds = F.embedding(batch["labels"], self.embedding).to(self.dtype)
        finite = bool((~torch.isnan(topk_logp) & (topk_logp < float("inf"))).all())  # -inf: a legal zero
        return FeatureBatch(batch["stored_hidden"].to(self.dtype), embeds, positions, target_logp, topk_ids[:, 0],
                            finite)

