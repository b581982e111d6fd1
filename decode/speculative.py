"""Target-only and speculative decoding (batch 1) over runners, sharing one cache path and one sampler.

Speculative step (Leviathan et al. 2023; Chen et al. 2023):
  1. the proposer offers d_1..d_k, each sampled from draft_probs_i (decode/proposal.py)
  2. the target scores [last committed, d_1..d_k] in one forward -> target_probs_0..k
  3. for i = 1..k: accept d_i with probability min(1, target_probs_i[d_i] / draft_probs_i[d_i]);
     on the first rejection emit a token from norm(max(0, target_probs_i - draft_probs_i)) and stop;
     if all k are accepted emit a bonus token from target_probs_k.
Every emitted token is then distributed exactly as target-only sampling would give it, as long as
both distributions are warped by the same SamplingParams. With temperature 0 both are one-hot, so
this reduces to "accept while the draft's argmax equals the target's" — exact greedy, which
`verify_greedy` computes directly from the logits (no vocabulary-wide one-hot or sampling per token).

A token proposed with probability 1 (prompt lookup) has a one-hot draft_probs_i: the test accepts
it with probability target_probs_i[d_i] and a rejection samples the target without d_i.

A vocabulary-subset draft is warped and sampled over its N rows: warping the full vocabulary
with -inf outside the subset gives the same distribution with zeros outside it, and only the
rejection step needs it spread over the full vocabulary. A spread_other subset draft
(decode/vocab.py) is warped and sampled over the full vocabulary like any other draft.

The one-call API over Hugging Face models (`decode.generate`, `decode.speculative_generate`) is
decode/api.py; the evaluation (decode/eval_speedup.py) calls these runner-level loops directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.sampling import SamplingParams, sample
from decode.checks import check_context, check_int, prompt_ids
from decode.proposal import Proposal, Proposer
from decode.runners import Runner
from decode.stats import SpeculativeStats


@dataclass
class SpeculativeOutput:
    tokens: torch.Tensor
    """New tokens, 1-D LongTensor (prompt excluded)."""
    stats: SpeculativeStats


def verify_block(drafted: list[int], draft_probs: list[torch.Tensor | None], target_probs: torch.Tensor,
                 generator: torch.Generator | None = None,
                 draft_ids: torch.Tensor | None = None) -> tuple[list[int], int]:
    """The acceptance rule. Returns (emitted tokens, number of drafted tokens accepted).

    drafted[i] was sampled from draft_probs[i]: [N] over the draft's rows, row r standing for token
    draft_ids[r] (a subset draft), or for token r when draft_ids is None (N = V, or N < V for a draft
    with fewer rows than the target, which gives the ids above them probability 0); or None when
    it was proposed with probability 1 (prompt lookup). target_probs [len(drafted)+1, V] is the
    target's warped distribution at each drafted position plus one more for the bonus token.

    The tests run one at a time and stop at the first rejection. A vectorised form (all uniforms
    drawn up front, one host synchronisation per block) measured slower per call on this project's
    2-core CPU (0.24-0.30 vs 0.18 ms) and on an H200 (0.43 vs 0.31-0.34 ms): stacking the proposals
    and copying the token lists to the device cost more than the synchronisations it saves.
    """
    rng_device = generator.device if generator is not None else target_probs.device
    emitted: list[int] = []
    for i, token in enumerate(drafted):
        proposal = draft_probs[i]
        # Accept with probability min(1, target/draft). The draft's probability > 0: the token was sampled from it.
        accept_prob = min(1.0, float(target_probs[i, token]) / draft_prob(proposal, token, draft_ids))
        if float(torch.rand((), generator=generator, device=rng_device)) < accept_prob:
            emitted.append(token)
            continue
        # Rejected: resample from the part of the target the draft under-covers.
        emitted.append(int(sample(residual(target_probs[i], proposal, token, draft_ids), generator)))
        return emitted, i
    emitted.append(int(sample(target_probs[len(drafted)], generator)))  # all accepted: bonus token
    return emitted, len(drafted)


def draft_prob(proposal: torch.Tensor | None, token: int, draft_ids: torch.Tensor | None) -> float:
    """The probability `proposal` ([N] over the draft's rows, as in verify_block; None: a one-hot)
    gave `token`."""
    if proposal is None:
        return 1.0
    return float(proposal[token] if draft_ids is None else proposal[draft_ids == token].sum())


def residual(target_row: torch.Tensor, proposal: torch.Tensor | None, token: int,
             draft_ids: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, target - draft)) [V]: what to sample after the draft's `token` was rejected.
    Its sum is 0 only when target == draft, where rejection cannot happen."""
    if proposal is None:  # max(0, target - one-hot(token)): the target without `token`
        left = target_row.clone()
        left[token] = 0.0
    else:
        vocab_size = target_row.shape[-1]
        if draft_ids is not None:
            draft_full = target_row.new_zeros(vocab_size).index_copy_(0, draft_ids, proposal)
        elif proposal.shape[-1] < vocab_size:  # a draft with fewer rows: probability 0 above them
            draft_full = F.pad(proposal, (0, vocab_size - proposal.shape[-1]))
        else:
            draft_full = proposal
        left = torch.clamp(target_row - draft_full, min=0.0)
    return left / left.sum()


def verify_greedy(drafted: list[int], target_logits: torch.Tensor) -> tuple[list[int], int]:
    """The acceptance rule at temperature 0 (one-hot distributions): accept while a drafted token
    is the target's argmax, then emit the target's argmax (the correction, or the bonus token).
    target_logits [len(drafted)+1, V]. Returns (emitted tokens, number accepted)."""
    best = target_logits.argmax(-1).tolist()
    for i, token in enumerate(drafted):
        if token != best[i]:
            return drafted[:i] + [best[i]], i
    return drafted + [best[len(drafted)]], len(drafted)


def target_decode(target_runner: Runner, input_ids: torch.Tensor, *, max_new_tokens: int,
                  sampling: SamplingParams, eos_token_id: int | list[int] | None = None,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Target-only decoding: the baseline speculative decoding is measured against, on the same cache
    path and sampler. Returns the new tokens, a 1-D LongTensor (cut after an EOS)."""
    committed = prompt_ids(input_ids, target_runner.vocab_size)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_context(len(committed), max_new_tokens, [target_runner.max_length])
    eos = eos_set(eos_token_id)
    target_runner.reset()
    new: list[int] = []
    while len(new) < max_new_tokens:
        logits = _feed(target_runner, committed, [], 1)[0]  # [V]
        if sampling.greedy:  # exact greedy, as the one-hot of sampling.warp would give
            token = int(logits.argmax())
        else:
            token = int(sample(sampling.warp(logits), generator))
        new.append(token)
        committed.append(token)
        if token in eos:
            break
    assert target_runner.length == len(committed) - 1
    return torch.tensor(new, dtype=torch.long)


def speculative_decode(target_runner: Runner, proposer: Proposer, input_ids: torch.Tensor, *, k: int,
                       max_new_tokens: int, sampling: SamplingParams,
                       eos_token_id: int | list[int] | None = None,
                       generator: torch.Generator | None = None) -> SpeculativeOutput:
    """Lossless speculative decoding: the output is distributed exactly as target_decode's.

    Each block: the proposer offers up to k tokens, one target forward scores them, the acceptance
    rule keeps a prefix and emits one more (a correction or a bonus token), both caches roll back."""
    committed = prompt_ids(input_ids, target_runner.vocab_size)
    check_int("k", k, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_context(len(committed), max_new_tokens, [target_runner.max_length, proposer.max_length])
    prompt_len, eos = len(committed), eos_set(eos_token_id)
    target_runner.reset()
    if prompt_len > 1:  # all but the last prompt token; the first verify forward feeds that one
        _feed(target_runner, committed[:-1], [], 1)
    proposer.reset(committed)
    stats = SpeculativeStats(k=k)
    while len(committed) - prompt_len < max_new_tokens:
        remaining = max_new_tokens - (len(committed) - prompt_len)
        # A block emits up to one token more than it proposes.
        proposal = proposer.propose(committed, min(k, remaining - 1), sampling, generator)
        emitted, accepted = _verify(target_runner, committed, proposal, sampling, generator)
        emitted, hit_eos = cut_at_eos(emitted, eos)
        committed.extend(emitted)
        _record(stats, proposal, accepted, emitted)
        # Roll back to "everything committed but the last token".
        target_runner.rollback(min(target_runner.length, len(committed) - 1))
        proposer.rollback(len(committed))
        assert target_runner.length == len(committed) - 1
        if hit_eos:
            break
    assert len(committed) - prompt_len <= max_new_tokens
    return SpeculativeOutput(tokens=torch.tensor(committed[prompt_len:], dtype=torch.long), stats=stats)


def _verify(target_runner: Runner, committed: list[int], proposal: Proposal, sampling: SamplingParams,
            generator: torch.Generator | None) -> tuple[list[int], int]:
    """One target forward over [unseen committed..., proposed...], then the acceptance rule on the
    target warped by the same SamplingParams as target-only decoding."""
    drafted = proposal.tokens
    target_logits = _feed(target_runner, committed, drafted, len(drafted) + 1)  # [len(drafted)+1, V]
    if sampling.greedy:
        return verify_greedy(drafted, target_logits)
    return verify_block(drafted, proposal.draft_probs, sampling.warp(target_logits), generator,
                        proposal.draft_ids)


def _record(stats: SpeculativeStats, proposal: Proposal, accepted: int, emitted: list[int]) -> None:
    proposed = len(proposal.tokens)
    tried = min(proposed, accepted + 1)  # the test stops at the first rejection
    # An EOS inside the block ends it: positions after the EOS were never really tested.
    accepted = min(accepted, len(emitted))
    stats.record_block(proposed=proposed, tried=min(tried, len(emitted)), accepted=accepted,
                       emitted=len(emitted), draft_forwards=proposal.draft_forwards,
                       looked_up=sum(proposal.from_lookup),
                       looked_up_accepted=sum(proposal.from_lookup[:accepted]))


def _feed(runner: Runner, committed: list[int], extra: list[int], num_logits: int) -> torch.Tensor:
    """Feed the committed tokens the runner has not seen yet, then `extra`."""
    ids = torch.tensor(committed[runner.length:] + extra, dtype=torch.long)
    return runner.forward(ids, num_logits)


def eos_set(eos_token_id: int | list[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False
