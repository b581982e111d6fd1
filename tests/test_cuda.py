"""The GPU paths (skipped without CUDA): generate-data's batched sampler and lossless decoding on a CUDA device."""

import pytest
import torch

from decode.graphs import MIN_CAPACITY, GraphLeanRunner
from decode.lean import LeanLlamaRunner
from decode.models import load_model
from decode.runner import make_runner
from decode.speculative import generate, speculative_generate
from distill.gen_llama import BatchedLlama
from distill.gen_sampling import generate_batch, row_uniforms
from tests.test_lean import SCHEDULE, _llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 49152


def _completions(target, top_p: float) -> list[list[int]]:
    prompts = [[1, 5, 9, 30], [1, 8, 9, 31, 40, 41], [1, 7]]
    uniforms = torch.stack([row_uniforms(0, f"p{i}", 0, 10) for i in range(len(prompts))])  # on the CPU
    out = generate_batch(BatchedLlama(target), prompts, uniforms, max_new_tokens=10, temperature=0.7, top_k=0,
                         top_p=top_p, eos_ids=[2], teacher_topk=4)
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
    assert isinstance(target_runner, GraphLeanRunner) and isinstance(draft_runner, GraphLeanRunner)
    base = generate(target, input_ids, max_new_tokens=24, target_runner=target_runner)
    for k in (1, 3):
        out = speculative_generate(target, draft, input_ids, k=k, max_new_tokens=24,
                                   target_runner=target_runner, draft_runner=draft_runner)
        assert out.tokens.tolist() == base.tolist()
    sampled = speculative_generate(target, draft, input_ids, k=3, max_new_tokens=24, temperature=0.7,
                                   generator=torch.Generator("cuda").manual_seed(0),
                                   target_runner=target_runner, draft_runner=draft_runner)
    assert len(sampled.tokens) == 24 and int(sampled.tokens.max()) < VOCAB


def test_graph_replays_match_the_eager_forward():
    """Captured graphs (1..9 rows, replayed at moving positions, across rollbacks and the cache's
    growth, which recaptures) give the eager lean forward's logits."""
    model = _llama(max_position_embeddings=MIN_CAPACITY + 64).cuda()
    eager, graphs = LeanLlamaRunner(model, 1000), GraphLeanRunner(model, 1000)
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
    assert graphs._forwards[5].graph is not None  # replayed, not run eagerly
