"""A feature draft's rollouts (distill/generation/feature_rollout.py): the draft writes blocks of k guesses from
the target's states of the text before them, the target adds one token per block, and every token gets the
target's top-k label and states. Checked against independent computations: a teacher-forced target forward
over each finished text (labels, states), and the draft's training-time unrolled forward on those states (each
guess is the unrolled step that has read the target's states up to the block's start). CPU, seconds."""

import pytest
import torch

from common.sampling import SamplingParams
from decode.api import build_ragged_runners
from distill.generation.feature_rollout import rollout_batch
from distill.training.feature_teacher import forward_keeping_layers
from tests.test_feature_proposer import target, trained  # noqa: F401 (a tiny target, a feature draft taught it)
from tests.test_feature_stored import BF16_TOLERANCE


pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[0, 3, 7, 2, 9], [5, 6], [4, 4, 8], [2, 9, 3, 7, 2, 9, 3], [6, 1, 0, 12]]
K = 3


def rollouts(target, draft, prompts, sampling, *, max_new_tokens=12, eos_ids=(), seed=0):
    generators = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]
    return rollout_batch(*build_ragged_runners(target, draft), prompts, generators, k=K, max_new_tokens=max_new_tokens,
                         sampling=sampling, eos_ids=list(eos_ids), teacher_topk=4)


def teacher_forced(target, layers, sequence):
    """(log-probs [T, V], states [T, layers, H]) of the target over `sequence`."""
    with torch.no_grad():
        out, states = forward_keeping_layers(target.model, layers, input_ids=torch.tensor([sequence]))
        return target.lm_head(out.last_hidden_state)[0].log_softmax(-1), states[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_token_has_the_target_label_and_states_of_its_text(target, trained, temperature):
    # EOS 15 ends some rows inside a block, some on the target's token; the others stop at the length cap.
    completions = rollouts(target, trained, PROMPTS, SamplingParams(temperature), max_new_tokens=13, eos_ids=[15])
    layers = trained.config.target_layers
    for prompt, c in zip(PROMPTS, completions, strict=True):
        tokens = c.completion_ids.tolist()
        assert c.finish_reason == ("eos" if 15 in tokens else "length") and (15 not in tokens[:-1])
        assert c.finish_reason == "eos" or len(tokens) == 13
        logprobs, states = teacher_forced(target, layers, prompt + tokens)
        # The label of completion token j: the target's top-k after the token before it.
        want = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].topk(4, dim=-1)
        assert c.topk_ids.tolist() == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(c.topk_logprobs), want.values, rtol=0, atol=1e-5)
        assert c.hidden.dtype == torch.bfloat16 and c.hidden.shape == states.shape  # the last token's states too
        torch.testing.assert_close(c.hidden.float(), states, rtol=BF16_TOLERANCE,
                                   atol=BF16_TOLERANCE * float(states.abs().max()))


def test_greedy_blocks_are_the_drafts_guesses_then_the_targets_token(target, trained):
    """Each block of k + 1 tokens: k guesses, guess j the draft's argmax at unrolled step j (having read the
    target's states up to the block's start, then its own outputs), then the target's argmax."""
    completions = rollouts(target, trained, PROMPTS, SamplingParams(0.0))
    layers, ids = trained.config.target_layers, trained.draft_ids
    guessed_as_target = guesses = 0
    for prompt, c in zip(PROMPTS, completions, strict=True):
        tokens = c.completion_ids.tolist()
        assert len(tokens) == 12 and c.finish_reason == "length"  # 3 whole blocks of K + 1
        sequence = prompt + tokens
        logprobs, states = teacher_forced(target, layers, sequence)
        embeds = target.get_input_embeddings().weight[torch.tensor(sequence[1:] + [0])][None]
        with torch.no_grad():
            steps = [trained.logits(out)[0].argmax(-1) for out in trained.unrolled(states[None], embeds, K)]
        for block in range(len(tokens) // (K + 1)):
            n = len(prompt) + block * (K + 1)  # tokens committed when the block was drafted
            for j in range(K):  # guess j is token n + j, predicted at draft position n - 2 + j
                assert sequence[n + j] == int(ids[steps[j][n - 2 + j]])
                guesses += 1
                guessed_as_target += sequence[n + j] == int(logprobs[n + j - 1].argmax())
            assert sequence[n + K] == int(logprobs[n + K - 1].argmax())
    # The taught draft agrees with the target often, not always: the guesses are its own.
    assert 0 < guessed_as_target < guesses


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_rows_rollout_depends_on_neither_its_batch_nor_its_neighbours(target, trained, temperature):
    sampling = SamplingParams(temperature)
    together = rollouts(target, trained, PROMPTS, sampling, eos_ids=[15])
    for i, prompt in enumerate(PROMPTS):
        (alone,) = rollouts(target, trained, [prompt], sampling, eos_ids=[15], seed=i)
        assert alone.completion_ids.tolist() == together[i].completion_ids.tolist()
    if temperature:
        again = rollouts(target, trained, PROMPTS, sampling, eos_ids=[15], seed=7)
        assert [c.completion_ids.tolist() for c in again] != [c.completion_ids.tolist() for c in together]


def test_a_one_token_prompt_is_refused(target, trained):
    with pytest.raises(ValueError, match="2 tokens or more"):
        rollouts(target, trained, [[3, 4], [5]], SamplingParams())
