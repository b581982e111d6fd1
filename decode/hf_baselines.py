"""Hugging Face `generate` on the same prompts: greedy, assisted generation, prompt lookup.

These are comparisons, not our decoder: they show our target-only baseline is not slow
(so speedups are not inflated) and how our speculative loop compares with HF's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from common.sampling import SamplingParams
from decode.speculative import target_decode
from decode.timing import timed
from decode.vocab import VocabSubset


if TYPE_CHECKING:
    from decode.eval_speedup import Setup


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


def hf_comparisons(s: Setup, runs: list[dict], greedy_tokens: dict[tuple[str, str], list[int]]) -> list[dict]:
    """HF greedy, assisted generation and prompt lookup on the same prompts (greedy, timed the same way),
    each compared with our greedy runs on those prompts (`runs`: measure's per-prompt records)."""
    ev = s.cfg.eval
    # HF assisted generation runs a standalone draft only (it has no feature-draft mode).
    assistant = s.draft
    if s.draft is not None and VocabSubset.from_config(s.draft.config) is not None:
        assistant = full_vocab_view(s.draft)
    kinds = ("hf assisted", "hf prompt lookup") if assistant is not None else ("hf prompt lookup",)
    methods = [("hf greedy", None)] + [(m, k) for k in ev.hf_ks for m in kinds]
    rows = []
    for set_name, prompts in s.prompt_sets.items():
        prompts = prompts[: ev.hf_prompts or None]
        ids = {p.prompt_id for p in prompts}
        greedy_runs = [r for r in runs if r["prompt_set"] == set_name and r["temperature"] == 0
                       and r["prompt_id"] in ids and not r.get("tree")]
        for method, k in tqdm(methods, desc=f"hf baselines {set_name}", dynamic_ncols=True):
            tok_s, identical = time_hf_method(s, set_name, prompts, method, k, assistant, greedy_tokens)
            row = {"prompt_set": set_name, "method": method, "k": k, "tok_s": tok_s, "identical_to_ours": identical,
                   "n_prompts": len(prompts)}
            if greedy_runs:
                row["vs_our_baseline"] = tok_s / _our_baseline_tok_s(greedy_runs)
            # HF assisted generation runs the draft alone: compare it with our draft-only runs.
            draft_runs = [r for r in greedy_runs if r["proposer"] == "draft" and r["k"] == k]
            if k is not None and draft_runs:
                tokens, seconds = (sum(r[f"speculative_{x}"] for r in draft_runs) for x in ("tokens", "s"))
                row["ours_over_this"] = tokens / seconds / tok_s
            rows.append(row)
    return rows


def _our_baseline_tok_s(runs: list[dict]) -> float:
    """Our target-only tokens/s pooled over the prompts of `runs` (each prompt's one timing, which every
    (k, proposer) run of that prompt repeats)."""
    by_prompt = {r["prompt_id"]: (r["baseline_tokens"], r["baseline_s"]) for r in runs}
    return sum(t for t, _ in by_prompt.values()) / sum(s for _, s in by_prompt.values())


def time_hf_method(s: Setup, set_name: str, prompts: list, method: str, k: int | None, assistant,
                   greedy_tokens: dict[tuple[str, str], list[int]]) -> tuple[float, bool]:
    """(tokens/s pooled over the prompts, whether every output equals our target-only greedy tokens)."""
    ev, eos = s.cfg.eval, s.tokenizer.eos_token_id
    tokens, seconds, identical = 0, 0.0, True
    for prompt in prompts:
        input_ids = torch.tensor([prompt.token_ids], device=s.device)
        key = (set_name, prompt.prompt_id)
        if key not in greedy_tokens:
            greedy_tokens[key] = target_decode(s.target_runner, input_ids, max_new_tokens=ev.max_new_tokens,
                                               sampling=SamplingParams(), eos_token_id=eos).tolist()
        times: list[float] = []
        with timed(s.device, times):
            new = hf_generate(s.target, input_ids, ev.max_new_tokens, eos,
                              assistant=assistant if method == "hf assisted" else None, k=k or 4,
                              prompt_lookup=method == "hf prompt lookup")
        tokens += len(new)
        seconds += times[0]
        identical &= new.tolist() == greedy_tokens[key]
    return tokens / seconds, identical
