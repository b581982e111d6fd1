"""The same batched interface as `gen_llama.BatchedLlama`, through any HF causal LM's forward.

Used for models the lean Llama runner does not cover (backend 'auto') or when forced
(backend 'hf'); also the reference the lean runner is tested against.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class BatchedHF:
    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], capacity: int, all_hidden: bool = False):
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, L, dtype=torch.long, device=self.device)
        self.mask = torch.zeros(B, L, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
            self.mask[b, L - len(p):] = 1
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        if all_hidden:
            out = self.model.base_model(input_ids=ids, attention_mask=self.mask, position_ids=positions)
            return out.last_hidden_state
        self.cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                         cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def logits(self, hidden):
        return self.model.get_output_embeddings()(hidden).float()

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = self.mask.sum(-1, keepdim=True)  # [B, 1]: real tokens so far
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=positions,
                         cache=self.cache, use_cache=True)
        return out.logits[:, -1].float()

    def keep(self, rows: torch.Tensor) -> None:
        self.mask = self.mask[rows]
        self.cache.batch_select_indices(rows)
