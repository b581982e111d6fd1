"""Hugging Face `generate` on the same prompts: greedy, assisted generation, prompt lookup.

These are comparisons, not our decoder: they show our target-only baseline is not slow
(so speedups are not inflated) and how our speculative loop compares with HF's.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig

from decode.sampling import SamplingParams
from decode.vocab import VocabSubset


def full_vocab_view(draft):
    """The same vocabulary-subset draft presented to HF assisted generation as a full-vocabulary
    model: input ids are mapped to the subset's rows and logits put back over the full vocabulary
    (VocabSubset.full_logits).
    A subclass of the draft's own class, so HF's generation machinery treats it as usual."""
    subset = VocabSubset.of(draft)

    class FullVocabDraft(type(draft)):
        def forward(self, input_ids=None, **kwargs):
            out = super().forward(input_ids=subset.rows(input_ids), **kwargs)
            out.logits = subset.full_logits(out.logits)
            return out

    view = FullVocabDraft(copy.deepcopy(draft.config))
    view.load_state_dict(draft.state_dict())
    view.generation_config = draft.generation_config
    view.config.vocab_size = subset.full_vocab_size  # what HF reads; the weights keep their subset shape
    return view.to(device=draft.device, dtype=draft.dtype).eval()


def hf_generate(target, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id, *, assistant=None,
                k: int = 4, prompt_lookup: bool = False, ngram: int = 2,
                sampling: SamplingParams = SamplingParams()) -> torch.Tensor:
    """HF generate, greedy unless `sampling` has a temperature (then seeded by torch's global generator);
    returns the new tokens [n]. ngram: prompt lookup's longest matched n-gram (HF's default is 2)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, eos_token_id=eos_token_id,
                              pad_token_id=eos_token_id if isinstance(eos_token_id, int) else None)
    if not sampling.greedy:  # set all three: unset ones would fall back to the model's generation defaults
        config.temperature, config.top_k, config.top_p = sampling.temperature, sampling.top_k, sampling.top_p
    kwargs = {}
    if assistant is not None:
        config.num_assistant_tokens = k
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    if prompt_lookup:
        config.prompt_lookup_num_tokens = k
        config.max_matching_ngram_size = ngram
    with torch.inference_mode():
        out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                              generation_config=config, **kwargs)
    return out[0, input_ids.shape[1]:]
