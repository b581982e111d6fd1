"""The one-call API over Hugging Face causal LMs: check the arguments, build the runners and the
proposer, run the loops of decode/speculative.py.

    from decode import generate, speculative_generate
    tokens = generate(target, input_ids, max_new_tokens=64, temperature=0.7, generator=g)
    out = speculative_generate(target, draft, input_ids, k=4, max_new_tokens=64, lookup_ngram=3)
    out = speculative_generate(target, FeatureDraft.load(folder), input_ids, k=4, max_new_tokens=64)
    outcomes = speculative_generate_batch(target, draft, [ids_1, ids_2, ...], k=2, batch_size=4, max_new_tokens=64)
"""

from __future__ import annotations

import torch

from common.sampling import SamplingParams
from decode.batched_speculative import AdaptiveK, RowOutcome, check_cache_memory, check_serving, serve
from decode.checks import check_int, prompt_ids
from decode.drafts.feature.model import FeatureDraft, check_target
from decode.drafts.feature.proposer import make_feature_proposer
from decode.drafts.feature.ragged import RaggedFeatureDrafter
from decode.proposers import check_lookup_ngram, make_proposer
from decode.runners import Runner, make_runner
from decode.runners.ragged import RaggedRunner
from decode.speculative import SpeculativeOutput, speculative_decode, target_decode
from decode.vocab import model_vocab_size


def build_runners(target: torch.nn.Module, draft: torch.nn.Module, backend: str = "auto") -> tuple[Runner, Runner]:
    """(target runner, draft runner). The target's runner speaks its whole vocabulary, whatever the
    draft's. A draft with padded embedding rows beyond the target's vocabulary is cut to it; a draft
    with fewer rows (and no subset) keeps them, and gives every id above them probability 0."""
    target_vocab = model_vocab_size(target)
    draft_vocab = min(model_vocab_size(draft), target_vocab)
    return make_runner(target, target_vocab, backend), make_runner(draft, draft_vocab, backend)


def build_feature_runner(target: torch.nn.Module, draft: FeatureDraft, backend: str = "auto") -> Runner:
    """The target's runner for a feature draft: it keeps the hidden states of the layers the draft reads.
    Refuses a draft made for another target before building it."""
    target_vocab = model_vocab_size(target)
    check_target(draft.config, target.config, target_vocab)
    return make_runner(target, target_vocab, backend, hidden_layers=draft.config.target_layers)


def generate(target: torch.nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None,
             backend: str = "auto") -> torch.Tensor:
    """Target-only decoding of input_ids (a LongTensor [1, L]): the new tokens as a 1-D LongTensor.
    Same runner and sampler as `speculative_generate`."""
    sampling = SamplingParams(temperature, top_k, top_p)
    vocab = model_vocab_size(target)
    prompt_ids(input_ids, vocab)
    check_int("max_new_tokens", max_new_tokens, 1)
    return target_decode(make_runner(target, vocab, backend), input_ids, max_new_tokens=max_new_tokens,
                         sampling=sampling, eos_token_id=eos_token_id, generator=generator)


def speculative_generate(target: torch.nn.Module, draft: torch.nn.Module, input_ids: torch.Tensor, *, k: int,
                         max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None,
                         backend: str = "auto", lookup_ngram: int = 0) -> SpeculativeOutput:
    """Lossless speculative decoding: output distributed exactly as `generate(target, ...)`.

    `target` and `draft` are Hugging Face causal LMs sharing a tokenizer, or `draft` is a FeatureDraft
    made for this target (decode/drafts/feature/model.py, reading the target's hidden states); input_ids is [1, L].
    lookup_ngram > 0 (at least 2) adds prompt lookup (`decode.lookup`): where the last n tokens
    (n = lookup_ngram down to 2) occurred earlier in the prompt or output, the token that followed
    them is proposed with probability 1 instead of running the draft. The proposal still depends
    only on the text so far, so the acceptance rule keeps the output exactly the target's.
    """
    sampling = SamplingParams(temperature, top_k, top_p)
    prompt_ids(input_ids, model_vocab_size(target))
    check_int("k", k, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_lookup_ngram(lookup_ngram)
    if isinstance(draft, FeatureDraft):
        target_runner = build_feature_runner(target, draft, backend)
        proposer = make_feature_proposer(target_runner, draft, target.get_input_embeddings().weight, lookup_ngram)
    else:
        target_runner, draft_runner = build_runners(target, draft, backend)
        proposer = make_proposer(draft_runner, lookup_ngram)
    return speculative_decode(target_runner, proposer, input_ids, k=k,
                              max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=eos_token_id,
                              generator=generator)


def speculative_generate_batch(target: torch.nn.Module, draft: torch.nn.Module | None,
                               prompts: list[list[int]] | list[torch.Tensor], *, k: int, batch_size: int,
                               max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                               eos_token_id: int | list[int] | None = None,
                               generators: list[torch.Generator | None] | None = None, p_min: float = 0.0,
                               adaptive: bool = False, lookup_ngram: int = 0) -> list[RowOutcome]:
    """Many prompts at once with continuous batching (decode/batched_speculative.py): up to `batch_size` rows
    decode together, finished rows leave and waiting prompts join, and each row is lossless on its own, drawing
    from generators[i] (one per prompt), so its output does not depend on its neighbours. `draft`: as in
    speculative_generate, or None for target-only decoding at the same batch size. prompts: token id lists or
    [1, L] LongTensors. Returns one RowOutcome (tokens, stats, seconds) per prompt, in prompt order.
    p_min stops a row's drafting after a guess its draft gave less than that probability; adaptive=True
    chooses k (0..k) per round from timed rounds; lookup_ngram as in speculative_generate (standalone drafts).
    Bad arguments, prompts that do not fit the target's context and batches whose caches would not fit in
    free memory are refused before any runner is built."""
    sampling = SamplingParams(temperature, top_k, top_p)
    vocab = model_vocab_size(target)
    ids = _batch_prompt_ids(prompts, vocab)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_serving(batch_size, k, p_min)
    check_lookup_ngram(lookup_ngram)
    if lookup_ngram and isinstance(draft, FeatureDraft):
        raise ValueError("lookup_ngram needs a standalone draft: the feature draft reads its guesses one at a time")
    if generators is not None and len(generators) != len(ids):
        raise ValueError(f"generators: one per prompt, got {len(generators)} for {len(ids)} prompts")
    _check_context(target, ids, max_new_tokens, k)
    check_cache_memory(batch_size, max(map(len, ids)), max_new_tokens, k,
                       [m for m in (target, draft) if m is not None and not isinstance(m, FeatureDraft)])
    target_runner, draft_runner = build_ragged_runners(target, draft)
    return serve(target_runner, draft_runner, ids, batch_size=batch_size, k=k, max_new_tokens=max_new_tokens,
                 sampling=sampling, eos_token_id=eos_token_id, generators=generators, p_min=p_min,
                 adaptive=AdaptiveK(k) if adaptive and draft is not None and k else False, lookup_ngram=lookup_ngram)


def build_ragged_runners(target: torch.nn.Module, draft: torch.nn.Module | None
                         ) -> tuple[RaggedRunner, RaggedRunner | RaggedFeatureDrafter | None]:
    """(target runner, draft runner) of batched decoding: a standalone draft's RaggedRunner, a FeatureDraft's
    drafter over a target runner that keeps the layers it reads, or None (target-only)."""
    vocab = model_vocab_size(target)
    if not isinstance(draft, FeatureDraft):
        return RaggedRunner(target, vocab), RaggedRunner(draft, vocab) if draft is not None else None
    check_target(draft.config, target.config, vocab)
    target_runner = RaggedRunner(target, vocab, hidden_layers=draft.config.target_layers)
    return target_runner, RaggedFeatureDrafter(target_runner, draft, target.get_input_embeddings().weight)


def _batch_prompt_ids(prompts, vocab_size: int) -> list[list[int]]:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token id lists or [1, L] LongTensors")
    ids = []
    for i, prompt in enumerate(prompts):
        tensor = prompt if isinstance(prompt, torch.Tensor) else torch.tensor([list(prompt)], dtype=torch.long)
        try:
            ids.append(prompt_ids(tensor, vocab_size))
        except (TypeError, ValueError) as error:
            raise type(error)(f"prompts[{i}]: {error}") from None
    return ids


def _check_context(target: torch.nn.Module, ids: list[list[int]], max_new_tokens: int, k: int) -> None:
    """A row holds its prompt, its new tokens and a block of k guesses: all within the target's positions."""
    limit = getattr(target.config, "max_position_embeddings", None)
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    needed = len(ids[longest]) + max_new_tokens + k
    if limit is not None and needed > limit:
        raise ValueError(f"prompts[{longest}] has {len(ids[longest])} tokens: with max_new_tokens={max_new_tokens} "
                         f"and k={k} a row needs {needed} positions, the target has {limit}")
