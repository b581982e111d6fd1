"""The GPU paths (skipped without CUDA): generate-data's batched sampler and lossless decoding on a CUDA device."""

import pytest
import torch

from common.models import load_model
from common.sampling import SamplingParams
from decode.drafts.standalone.proposer import DraftProposer
from decode.runners import make_runner
from decode.runners.batched import LeanBatchedRunner
from decode.runners.graphs import MIN_CAPACITY, GraphRunner
from decode.runners.lean import LeanRunner
from decode.speculative import speculative_decode, target_decode
from distill.generation.batched_loop import generate_batch
from distill.generation.runner_engine import row_uniforms
from tests.conftest import small_llama
from tests.test_graphs import TREES, check_capture, check_greedy_trees, check_tree_forward
from tests.test_lean import SCHEDULE, _llama


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 49152


def _completions(target, top_p: float) -> list[list[int]]:
    prompts = [[1, 5, 9, 30], [1, 8, 9, 31, 40, 41], [1, 7]]
    uniforms = torch.stack([row_uniforms(0, f"p{i}", 0, 10) for i in range(len(prompts))])  # on the CPU
    out = generate_batch(LeanBatchedRunner(target), prompts, uniforms, max_new_tokens=10,
                         sampling=SamplingParams(0.7, 0, top_p), eos_ids=[2], teacher_topk=4)
    return [c.completion_ids.tolist() for c in out]


def test_generate_batch_on_cuda_draws_the_cpu_tokens():
    cpu, cuda = load_model("tiny:target"), load_model("tiny:target", "cuda")
    # top-p 0.95 on the tiny (nearly flat) target takes the full-sort fallback; it must run on the GPU.
    assert all(len(c) == 10 and max(c) < VOCAB for c in _completions(cuda, 0.95))
    # Without top-p only fp64 CDF steps can move a draw: CUDA and CPU draw the same tokens.
    assert _completions(cuda, 1.0) == _completions(cpu, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_greedy_on_cuda_equals_target_only(dtype):
    target = load_model("tiny:target", "cuda", dtype)
    draft = load_model("tiny:draft", "cuda", dtype)
    input_ids = torch.tensor([[1, 5, 9, 30, 7]], device="cuda")
    target_runner, draft_runner = make_runner(target, VOCAB), make_runner(draft, VOCAB)
    assert isinstance(target_runner, GraphRunner) and isinstance(draft_runner, GraphRunner)
    proposer = DraftProposer(draft_runner)
    base = target_decode(target_runner, input_ids, max_new_tokens=24, sampling=SamplingParams())
    for k in (1, 3):
        out = speculative_decode(target_runner, proposer, input_ids, k=k, max_new_tokens=24,
                                 sampling=SamplingParams())
        assert out.tokens.tolist() == base.tolist()
    sampled = speculative_decode(target_runner, proposer, input_ids, k=3, max_new_tokens=24,
                                 sampling=SamplingParams(temperature=0.7),
                                 generator=torch.Generator("cuda").manual_seed(0))
    assert len(sampled.tokens) == 24 and int(sampled.tokens.max()) < VOCAB


def test_graph_replays_match_the_eager_forward():
    """Captured graphs (1..9 rows, replayed at moving positions, across rollbacks and the cache's
    growth, which recaptures) give the eager lean forward's logits."""
    model = _llama(max_position_embeddings=MIN_CAPACITY + 64).cuda()
    eager, graphs = LeanRunner(model, 1000), GraphRunner(LeanRunner(model, 1000))
    gen = torch.Generator().manual_seed(0)
    schedule = SCHEDULE + SCHEDULE + [(MIN_CAPACITY - 20, 1)] + [(5, 5)] * 8  # the last calls grow the cache
    for n, num_logits in schedule:
        if n == "rollback":
            eager.rollback(num_logits)
            graphs.rollback(num_logits)
            continue
        ids = torch.randint(0, 1000, (n,), generator=gen)
        torch.testing.assert_close(graphs.forward(ids, num_logits), eager.forward(ids, num_logits),
                                   atol=1e-4, rtol=0)
    assert graphs.capacity == MIN_CAPACITY + 64
    assert (5, False) in graphs.static_shapes and graphs._forwards[(5, False)].graph is not None  # replayed


def test_tree_replays_match_the_eager_forward_and_keep_hidden_states():
    check_tree_forward(small_llama(seed=0, layers=2).cuda(), capture=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", TREES)
def test_greedy_trees_and_feature_drafts_from_graphs_equal_target_only(shape, dtype):
    check_greedy_trees(small_llama(seed=0, layers=2).to("cuda", dtype), shape, capture=True)


def test_captures_up_front_leave_decoding_unchanged_on_cuda():
    check_capture(small_llama(seed=0, layers=2).cuda(), capture=True)
