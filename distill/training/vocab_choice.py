"""The vocabulary subset a new draft emits: the most frequent tokens of its training data."""

from __future__ import annotations

from collections.abc import Callable

import torch

from decode.drafts.standalone.build import select_vocab
from decode.vocab import VocabSubset
from distill.data import token_counts


def choose_subset(target, tokenizer, train_set, eval_set, size: int, spread_other: bool,
                  say: Callable[[str], None], outside_rank: int = 0) -> VocabSubset:
    """The `size` most frequent tokens of `train_set`, special tokens included (with outside_rank factored
    outside rows: decode/vocab.py); says what share of the held-out completion tokens (`eval_set`) they cover."""
    full_vocab = target.get_input_embeddings().weight.shape[0]
    special = [i for i in tokenizer.all_special_ids if i < full_vocab]
    ids = select_vocab(token_counts(train_set, full_vocab), size, special + [target.config.eos_token_id])
    subset = VocabSubset(ids, full_vocab, spread_other=spread_other, outside_rank=outside_rank)
    held = [t for ex in eval_set for t in ex.ids[ex.n_prompt:].tolist()]
    if held:
        covered = float((subset.output_rows[torch.tensor(held)] >= 0).float().mean())
        say(f"vocab subset: {subset.size} tokens cover {covered:.1%} of held-out completion tokens")
    return subset
