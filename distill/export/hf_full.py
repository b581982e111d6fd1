"""The full-vocabulary HF folder (`--format hf-full`): a plain causal LM over the target's whole
vocabulary, with the target's tokenizer files, that loads with no code of this project (HF
`assistant_model`, vLLM `draft_model`, SGLang STANDALONE, and `--format gguf` for llama.cpp).

A vocabulary-subset draft has N + 1 rows (decode/vocab.py). A spread_other draft was trained with
its "other" logit as the logit of EACH of the V - N tokens outside the subset, so giving every
outside id the "other" row's input embedding and head row (the same rows when tied) yields a model
whose full-vocabulary distribution is exactly the one the draft was trained to, and the one this
project's decoder samples from: native and exported acceptance match.

With factored outside rows (decode/vocab.py) the outside ids' head rows are w_other + U_j P, materialised;
they read the "other" row on input as before, so input embedding and head are untied in the export (each
[V, hidden]).

An older subset draft's "other" logit is the outside MASS, and its decoder gives the outside tokens
probability 0. No full-vocabulary Llama gives exactly that (a bias-free linear head cannot put -inf
at V - N ids), so its export is refused unless the caller accepts a different draft distribution
(lossy_acceptance: outside ids get the "other" row as above, which over-weights them V - N times;
decoding stays lossless, only acceptance changes).
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from common.errors import UserError
from common.outside_factors import FACTORS_NAME
from decode.vocab import VocabSubset


class LossyExportError(UserError):
    """A subset draft whose exported full-vocabulary distribution would differ from its own."""


def exports_exactly(subset: VocabSubset | None) -> bool:
    """Whether the full-vocabulary model of a draft with this subset (None: a full-vocabulary draft)
    gives exactly the distribution it was trained to."""
    return subset is None or subset.spread_other


def full_vocab_model(draft: torch.nn.Module, lossy_acceptance: bool = False) -> torch.nn.Module:
    """The draft over the full vocabulary (a full-vocabulary draft is returned as it is)."""
    subset = VocabSubset.of(draft, "cpu")
    if subset is None:
        return draft
    if not exports_exactly(subset) and not lossy_acceptance:
        raise LossyExportError(
            "this subset draft does not spread its \"other\" row over the tokens outside the subset (trained "
            "with distill.spread_other=false, or before that setting existed): as a full-vocabulary model it "
            "would give those tokens a different probability than the project's decoder does (so a serving "
            "engine would accept less often). Retrain it with distill.spread_other=true (the default), or pass "
            "--lossy-acceptance to export it anyway.")
    config = copy.deepcopy(draft.config)
    VocabSubset.remove_from(config)
    config.vocab_size = subset.full_vocab_size
    if subset.factored:
        config.tie_word_embeddings = False
    full = AutoModelForCausalLM.from_config(config, dtype=next(draft.parameters()).dtype)
    _copy_expanded_weights(draft, full, subset)
    full.generation_config = copy.deepcopy(draft.generation_config)
    return full.eval()


@torch.no_grad()
def _copy_expanded_weights(draft, full, subset: VocabSubset) -> None:
    """Every weight of `draft` into `full`; embedding (and an untied head) expanded from the draft's rows to
    V (outside ids read the "other" row); factored outside rows materialised in the head."""
    embed_names = {"model.embed_tokens.weight", "lm_head.weight"}
    state = {name: value for name, value in draft.state_dict().items()
             if name not in embed_names and name != FACTORS_NAME}
    missing, unexpected = full.load_state_dict(state, strict=False)
    if unexpected or set(missing) - embed_names:
        raise ValueError(f"cannot map the draft's weights onto a full-vocabulary copy: missing "
                         f"{sorted(set(missing) - embed_names)}, unexpected {sorted(unexpected)}")
    rows = subset.input_rows.cpu()  # full id -> draft row
    full.get_input_embeddings().weight.copy_(draft.get_input_embeddings().weight[rows])
    head, draft_head = full.get_output_embeddings().weight, draft.get_output_embeddings().weight
    if subset.factored:
        basis = draft_head[subset.other_row + 1:subset.head_rows]  # P [r, hidden]
        outside = draft_head[subset.other_row] + subset.outside_factors.to(draft_head.dtype) @ basis  # [V - N, hidden]
        head.copy_(torch.cat([draft_head[: subset.size], outside])[subset.full_columns.cpu()])
    elif head.data_ptr() != full.get_input_embeddings().weight.data_ptr():  # untied: its own rows
        head.copy_(draft_head[rows])
