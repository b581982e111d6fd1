"""Hugging Face `generate` on the same prompts: greedy, assisted generation, prompt lookup.

These are comparisons, not our decoder: they show our target-only baseline is not slow
(so speedups are not inflated) and how our speculative loop compares with HF's.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig


class FullVocabDraft(torch.nn.Module):
    """Presents a vocabulary-subset draft to HF assisted generation as a full-vocabulary model:
    input ids are mapped into the subset and logits are scattered back with -inf elsewhere."""

    def __init__(self, draft, full_vocab_size: int):
        super().__init__()
        self.draft = draft
        ids = torch.tensor(draft.config.draft_vocab_ids, dtype=torch.long, device=draft.device)
        self.register_buffer("subset_ids", ids, persistent=False)
        input_map = torch.full((full_vocab_size,), len(ids), dtype=torch.long, device=draft.device)
        input_map[ids] = torch.arange(len(ids), device=draft.device)
        self.register_buffer("input_map", input_map, persistent=False)
        self.config = copy.deepcopy(draft.config)
        self.config.vocab_size = full_vocab_size
        self.generation_config = draft.generation_config
        self.main_input_name = "input_ids"

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.draft, name)

    def forward(self, input_ids=None, **kwargs):
        out = self.draft(input_ids=self.input_map[input_ids], **kwargs)
        logits = out.logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.subset_ids] = logits[..., : self.subset_ids.shape[0]]
        out.logits = full
        return out


def hf_generate(target, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id, *, assistant=None,
                k: int = 4, prompt_lookup: bool = False) -> torch.Tensor:
    """Greedy HF generate; returns the new tokens [n]."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                              pad_token_id=eos_token_id if isinstance(eos_token_id, int) else None)
    kwargs = {}
    if assistant is not None:
        config.num_assistant_tokens = k
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    if prompt_lookup:
        config.prompt_lookup_num_tokens = k
    with torch.inference_mode():
        out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                              generation_config=config, **kwargs)
    return out[0, input_ids.shape[1]:]
