"""The lean Llama runner computes what the Hugging Face forward computes."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from common.models import tiny_model
from decode import generate, speculative_generate
from decode.runners import lean, make_runner, projection
from decode.runners.hf import HFRunner
from decode.runners.lean import CACHE_CHUNK, LeanRunner
from decode.runners.llama import lean_supported
from decode.runners.projection import (BATCHED_TIMED_ROWS, LAYOUTS, ROW_BLOCK, TIMED_ROWS, CastProjection, Projection,
                                       tune_batched_layouts, tune_layouts)
from decode.vocab import VocabSubset


ATOL = 1e-4


def _llama(seed=0, **overrides) -> LlamaForCausalLM:
    # Untied embeddings, 8 query heads over 2 KV heads, a non-default rope theta.
    shape = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=False, rope_theta=5000.0)
    shape.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    with torch.no_grad():  # HF initialises biases to zero, which would hide a bias left out
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.5)
    return model


def _subset_draft(vocab: int, n: int, seed=3) -> LlamaForCausalLM:
    """A draft speaking n ids of a `vocab`-token vocabulary, plus the "other" row."""
    draft = _llama(seed, vocab_size=n + 1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=1, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(seed)
    VocabSubset(sorted(torch.randperm(vocab, generator=gen)[:n].tolist()), vocab).write_to(draft.config)
    return draft


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # short, so the schedule's positions span it

MODELS = {
    "tiny_target": lambda: tiny_model("target"),
    "untied_gqa4": lambda: _llama(),
    "llama3_rope": lambda: _llama(rope_scaling=LLAMA3_ROPE),  # Llama 3.x's frequency scaling
    "linear_rope": lambda: _llama(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "attention_bias": lambda: _llama(attention_bias=True),  # q/k/v and o biases
    "mlp_bias": lambda: _llama(mlp_bias=True),  # gate/up and down biases
}

# (new tokens, logits kept) per call; ("rollback", length) drops positions >= length.
SCHEDULE = [(9, 3), (1, 1), (5, 5), (3, 2), ("rollback", 12), (4, 4), (1, 1), ("rollback", 3), (6, 1), (2, 2)]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layouts", [(name,) * len(TIMED_ROWS) for name in LAYOUTS] + [("mm", "linear", "packed", "mm")])
def test_projection_layouts_compute_x_times_w_transposed(layouts, with_bias):
    """Every layout (gemv, w @ x.T, packed oneDNN) gives x @ w.T (+ bias) at every row count."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 576, generator=gen) / 576**0.5
    bias = torch.randn(300, generator=gen) if with_bias else None
    proj = Projection(w, bias, layouts=layouts)
    assert (proj.packed is not None) == ("packed" in layouts)  # a packed copy only where it is used
    for m in range(1, 15):
        x = torch.randn(m, 576, generator=gen)
        got = proj(x)
        assert got.shape == (m, 300) and got.is_contiguous()
        expected = x @ w.T if bias is None else x @ w.T + bias
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    rows = torch.randn(3, 4, 576, generator=gen)  # batched rows [b, L, in]: one matmul of b * L rows
    expected = rows @ w.T if bias is None else rows @ w.T + bias
    torch.testing.assert_close(proj(rows), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["linear", "packed"])
def test_batched_projection_layouts_compute_x_times_w_transposed(layout):
    """A batched projection gives x @ w.T + bias for [rows, in] and [b, L, in] through either layout."""
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(300, 576, generator=gen) / 576**0.5, torch.randn(300, generator=gen)
    proj = CastProjection(w, bias, None)
    proj.use(layout)
    assert (proj.packed is not None) == (layout == "packed")
    for x in (torch.randn(1, 576, generator=gen), torch.randn(70, 576, generator=gen),
              torch.randn(3, 5, 576, generator=gen)):
        torch.testing.assert_close(proj(x), x @ w.T + bias, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["linear", "packed"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_batched_gate_up_projection_computes_silu_gate_times_up(layout, dtype):
    """`gated` of a fused gate/up weight [2 I, in] is silu(x @ gate.T + b) * (x @ up.T + b) through either layout
    (packed: silu and the product fused into oneDNN's two GEMMs), in fp32 and, where native, bf16."""
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(2 * 96, 64, generator=gen) / 8, torch.randn(2 * 96, generator=gen) / 4
    proj = CastProjection(w, bias, dtype)
    if layout == "packed" and not proj.packable:
        pytest.skip("oneDNN cannot pack this dtype here")
    proj.use(layout)
    w32, b32 = proj.w.float(), proj.bias.float()  # the weights as the GEMM sees them
    for x in (torch.randn(1, 64, generator=gen), torch.randn(70, 64, generator=gen),
              torch.randn(3, 5, 64, generator=gen)):
        gate, up = (x @ w32.T + b32).chunk(2, dim=-1)
        tolerance = dict(atol=1e-5, rtol=1e-5) if dtype is None else dict(atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(proj.gated(x).float(), F.silu(gate) * up, **tolerance)
    assert (proj.packed_halves is not None) == (layout == "packed")
    proj.use("linear")
    assert proj.packed is None and proj.packed_halves is None


def test_batched_projection_keeps_the_layout_timed_fastest(monkeypatch):
    """Per weight shape and dtype, the faster of F.linear and packed at BATCHED_TIMED_ROWS rows, timed once
    over every weight of that shape; a packed copy stays only where packed won; bf16 GEMMs are timed apart
    from fp32 ones of the same shape, where oneDNN computes bf16 natively (else F.linear, untimed)."""
    timed = []

    def seconds(group, layout, x):
        timed.append((tuple(group[0].w.shape), group[0].w.dtype, layout, len(group), x.shape[0]))
        return 1.0 if (layout == "packed") == (group[0].w.shape[0] == 40) else 2.0

    monkeypatch.setattr(projection, "_seconds_per_pass", seconds)
    monkeypatch.setattr(projection, "_measured", {})
    packed = [CastProjection(torch.randn(40, 24), None, None) for _ in range(2)]
    linear = CastProjection(torch.randn(24, 40), None, None)
    bf16 = CastProjection(torch.randn(40, 24), None, torch.bfloat16)
    native = bf16.packable
    tune_batched_layouts(packed + [linear, bf16])
    layouts = [p.layout for p in packed + [linear, bf16]]
    assert layouts == ["packed", "packed", "linear", "packed" if native else "linear"]
    assert all(p.packed is not None for p in packed) and linear.packed is None and (bf16.packed is not None) == native
    groups = [((40, 24), torch.float32, 2), ((24, 40), torch.float32, 1)] + [((40, 24), torch.bfloat16, 1)] * native
    assert sorted(timed, key=str) == sorted(((shape, dtype, layout, n, BATCHED_TIMED_ROWS) for shape, dtype, n in groups
                                             for layout in ("linear", "packed")), key=str)
    x = torch.randn(5, 24)
    torch.testing.assert_close(bf16(x), x @ bf16.w.float().T, atol=5e-2, rtol=2e-2)  # fp32 in, fp32 out
    timed.clear()
    again = CastProjection(torch.randn(40, 24), None, None)
    tune_batched_layouts([again])
    assert again.layout == "packed" and not timed  # measured once per shape


def test_projection_keeps_the_layout_measured_fastest(monkeypatch):
    """Each timed row count takes the layout that timed fastest over the weights of its shape, measured
    once per shape, and a forward of M rows uses the first timed count >= M."""
    fastest = dict(zip(TIMED_ROWS, ("linear", "mm", "packed", "linear")))
    timed = []  # (rows, layout, projections in the pass) of every timing pass

    def seconds(group, layout, x):
        timed.append((x.shape[0], layout, len(group)))
        return 1.0 if fastest[x.shape[0]] == layout else 2.0

    monkeypatch.setattr(projection, "_seconds_per_pass", seconds)
    monkeypatch.setattr(projection, "_measured", {})
    group = [Projection(torch.randn(40, 24), None) for _ in range(3)]
    other = Projection(torch.randn(24, 40), None)
    assert group[0].tunable and group[0].packed is not None  # F.linear and a packed copy until tuned
    tune_layouts(group + [other])
    assert all(p.layouts == ("linear", "mm", "packed", "linear") and p.packed is not None for p in group)
    assert {(m, layout) for m, layout, n in timed if n == 3} == {(m, l) for m in TIMED_ROWS for l in LAYOUTS}
    assert {n for _, _, n in timed} == {3, 1}  # one pass times every weight of a shape; another shape apart
    timed.clear()
    again = Projection(torch.randn(40, 24), None)  # the same shape: measured already
    tune_layouts([again])
    assert again.layouts == group[0].layouts and not again.tunable and not timed
    used = []
    monkeypatch.setattr(Projection, "run", lambda self, layout, x: used.append((x.shape[0], layout)))
    for m, layout in ((1, "linear"), (2, "mm"), (3, "mm"), (4, "packed"), (5, "packed"), (6, "linear"), (30, "linear")):
        again(torch.randn(m, 24))
        assert used[-1] == (m, layout)
    fp16 = Projection(torch.randn(40, 24).half(), None)  # neither fp32 nor bf16: F.linear, never timed
    assert fp16.layouts == ("linear",) * len(TIMED_ROWS) and not fp16.tunable
    with pytest.raises(ValueError, match="one of"):
        Projection(torch.randn(40, 24), None, layouts=("linear", "packed"))


@pytest.mark.parametrize("name", MODELS)
def test_matches_hf_runner_through_calls_and_rollbacks(name):
    model = MODELS[name]()
    vocab = model.config.vocab_size
    hf, lean = HFRunner(model, vocab), LeanRunner(model, vocab)
    gen = torch.Generator().manual_seed(0)
    committed: list[int] = []
    for n, num_logits in SCHEDULE:
        if n == "rollback":
            hf.rollback(num_logits)
            lean.rollback(num_logits)
            del committed[num_logits:]
            continue
        ids = torch.randint(0, vocab, (n,), generator=gen)
        committed += ids.tolist()
        expected = hf.forward(ids, num_logits)
        got = lean.forward(ids, num_logits)
        _close(got, expected)
        assert lean.length == hf.length == len(committed)
        # A fresh forward without any cache over everything committed so far.
        with torch.no_grad():
            fresh = model(input_ids=torch.tensor([committed]), logits_to_keep=num_logits).logits[0].float()
        _close(got, fresh)


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_hidden_states_are_the_hf_models_own(backend):
    """Each forward keeps the chosen layers' outputs for its ids: HF's output_hidden_states[i + 1]
    (the last layer's after the final norm), through calls and rollbacks."""
    model = _llama(num_hidden_layers=3)
    layers = (0, 2, 1)
    runner = make_runner(model, 1000, backend, hidden_layers=layers)
    assert runner.hidden_layers == layers
    gen = torch.Generator().manual_seed(0)
    committed: list[int] = []
    for n, num_logits in SCHEDULE:
        if n == "rollback":
            runner.rollback(num_logits)
            del committed[num_logits:]
            continue
        ids = torch.randint(0, 1000, (n,), generator=gen)
        committed += ids.tolist()
        runner.forward(ids, num_logits)
        with torch.no_grad():
            hf_states = model(input_ids=torch.tensor([committed]), output_hidden_states=True).hidden_states
        expected = torch.stack([hf_states[i + 1][0, -n:] for i in layers], dim=1)  # [n, 3, hidden]
        assert runner.hidden_states.shape == (n, len(layers), 256)
        torch.testing.assert_close(runner.hidden_states, expected, atol=ATOL, rtol=0)
    assert make_runner(model, 1000, backend).hidden_states is None
    with pytest.raises(ValueError, match="hidden_layers"):
        make_runner(model, 1000, backend, hidden_layers=(3,))


def test_cache_grows_past_a_chunk():
    model = _llama()
    lean = LeanRunner(model, 1000)
    ids = torch.randint(0, 1000, (CACHE_CHUNK + 40,), generator=torch.Generator().manual_seed(1))
    lean.forward(ids[:CACHE_CHUNK - 10], 1)
    assert lean.capacity == CACHE_CHUNK
    got = torch.cat([lean.forward(ids[i: i + 5], 5) for i in range(CACHE_CHUNK - 10, len(ids), 5)])
    assert lean.capacity > CACHE_CHUNK
    with torch.no_grad():
        fresh = model(input_ids=ids[None]).logits[0, CACHE_CHUNK - 10:]
    _close(got, fresh)


def test_subset_draft_scatters_to_full_vocab():
    vocab, n = 1000, 50
    draft = _subset_draft(vocab, n)
    hf, lean = HFRunner(draft, vocab), LeanRunner(draft, vocab)
    subset = VocabSubset.of(draft).ids
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[subset] = False
    gen = torch.Generator().manual_seed(2)
    # Inputs mix subset ids and ids outside it (fed as the "other" row).
    for ids in (subset[:7], torch.randint(0, vocab, (3,), generator=gen), subset[7:8]):
        got = lean.forward(ids, ids.shape[0])
        _close(got, hf.forward(ids, ids.shape[0]))
        assert got.shape == (ids.shape[0], vocab)
        assert torch.isinf(got[:, outside]).all() and (got[:, outside] < 0).all()
        assert torch.isfinite(got[:, subset]).all()


def test_bf16_close_to_hf():
    model = tiny_model("target").to(torch.bfloat16)
    hf, lean = HFRunner(model, 49152), LeanRunner(model, 49152)
    ids = torch.randint(0, 49152, (8,), generator=torch.Generator().manual_seed(3))
    for chunk in (ids[:5], ids[5:6], ids[6:]):
        got, expected = lean.forward(chunk, chunk.shape[0]), hf.forward(chunk, chunk.shape[0])
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=0)  # a few bf16 ulps


def test_a_bf16_projection_has_one_layout_and_multiplies_blocks_of_rows():
    """A CPU bf16 weight takes one layout for every row count, is never timed, and multiplies more than
    ROW_BLOCK rows in blocks of that many: still x @ w.T."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 576, generator=gen) / 576**0.5).bfloat16()
    proj = Projection(w, None)
    assert len(set(proj.layouts)) == 1 and not proj.tunable and proj.row_block == ROW_BLOCK
    calls = []
    run = proj.run
    proj.run = lambda layout, x: calls.append(x.shape[0]) or run(layout, x)
    x = torch.randn(2 * ROW_BLOCK + 5, 576, generator=gen).bfloat16()
    got = proj(x)
    assert calls == [ROW_BLOCK, ROW_BLOCK, 5]
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, atol=5e-2, rtol=2e-2)
    assert Projection(torch.randn(300, 576), None).row_block is None  # fp32: one matmul, layouts timed


def _random_tree(nodes: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """(parent of each node, -1 for the root's children; depth of each node) of a random tree."""
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, nodes)]
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return parents, torch.tensor(depths)


def _assert_rows_are_one_token_forwards(runner: LeanRunner, vocab: int) -> None:
    """Every row's logits bit for bit those of a one-token forward: a prompt fed whole or one token
    short, blocks of 1-45 rows (more than ROW_BLOCK), and a masked forward over a random tree against
    each node's path fed one token at a time."""
    gen = torch.Generator().manual_seed(5)
    prompt, text = torch.randint(0, vocab, (70,), generator=gen), torch.randint(0, vocab, (45,), generator=gen)

    def fed(chunks: list[int]) -> torch.Tensor:
        runner.reset()
        runner.forward(prompt[:-1], 1)
        ids, out, at = torch.cat([prompt[-1:], text]), [], 0
        for n in chunks:
            out.append(runner.forward(ids[at : at + n], n))
            at += n
        return torch.cat(out)

    alone = fed([1] * 46)
    runner.reset()
    assert torch.equal(runner.forward(prompt, 1)[0], alone[0])  # the prompt fed whole
    for chunks in ([2, 5, 3, 36], [45, 1], [1, 33, 12]):
        assert torch.equal(fed(chunks), alone), chunks
    parents, depths = _random_tree(20, gen)
    visible = torch.zeros(20, 90, dtype=torch.bool)
    visible[:, :70] = True
    paths = []
    for i in range(20):
        path, j = [], i
        while j >= 0:
            visible[i, 70 + j] = True
            path.insert(0, j)
            j = parents[j]
        paths.append(path)
    runner.reset()
    runner.forward(prompt, 1)
    tree_ids = torch.randint(0, vocab, (20,), generator=gen)
    tree = runner.forward_masked(tree_ids, 70 + depths, visible, 20)
    for i, path in enumerate(paths):
        runner.reset()
        runner.forward(prompt, 1)
        for node in path:
            logits = runner.forward(tree_ids[node : node + 1], 1)
        assert torch.equal(tree[i], logits[0]), (i, path)


def test_bf16_rows_are_bit_for_bit_one_token_forwards():
    """In bf16 on a CPU a row's logits do not depend on the rows beside it, so verifying k tokens (a chain
    or a tree) gives the logits decoding them one by one gives: greedy speculative output equals bf16
    target-only output token for token (bf16 rounds a ~1e-5 difference of summation order into others)."""
    runner = LeanRunner(_llama(vocab_size=4000).to(torch.bfloat16), 4000)
    assert runner.row_invariance in ("padded", "by_row")
    _assert_rows_are_one_token_forwards(runner, 4000)


def test_bf16_falls_back_to_rows_alone_where_blocks_differ(monkeypatch):
    """Where the checks find blocked matmuls or padded attention give a row other bits than alone, the
    runner multiplies and attends each row alone, exact by construction."""
    monkeypatch.setattr(lean, "rows_match_alone", lambda projections, rows: False)
    monkeypatch.setattr(lean, "padded_attention_is_row_invariant", lambda cache: False)
    runner = LeanRunner(_llama(vocab_size=4000).to(torch.bfloat16), 4000)
    assert runner.row_invariance == "by_row"
    assert all(p.row_block == 1 for p in runner.core.projections())
    _assert_rows_are_one_token_forwards(runner, 4000)


def test_bf16_greedy_speculative_equals_bf16_target_only():
    target = _llama(vocab_size=4000).to(torch.bfloat16)
    draft = _subset_draft(4000, 500).to(torch.bfloat16)
    prompt = torch.randint(0, 4000, (1, 40), generator=torch.Generator().manual_seed(4))
    plain = generate(target, prompt, max_new_tokens=24)
    for k in (1, 4):
        assert speculative_generate(target, draft, prompt, k=k, max_new_tokens=24).tokens.tolist() == plain.tolist()


@pytest.mark.parametrize("draft_kind", ["tiny", "subset"])
def test_decoders_match_across_backends(draft_kind):
    target = tiny_model("target")
    draft = tiny_model("draft") if draft_kind == "tiny" else _subset_draft(49152, 2000)
    prompt = torch.randint(0, 49152, (1, 11), generator=torch.Generator().manual_seed(4))
    outs = {}
    for backend in ("hf", "lean"):
        plain = generate(target, prompt, max_new_tokens=12, backend=backend)
        spec = speculative_generate(target, draft, prompt, k=3, max_new_tokens=12, backend=backend)
        outs[backend] = (plain.tolist(), spec.tokens.tolist(), spec.stats.position_accepted)
        assert spec.tokens.tolist() == plain.tolist()  # lossless (greedy)
    assert outs["lean"] == outs["hf"]


def test_make_runner_picks_lean_for_llama():
    model = tiny_model("target")
    assert isinstance(make_runner(model, 49152, "auto"), LeanRunner)
    assert isinstance(make_runner(model, 49152, "hf"), HFRunner)


@pytest.mark.parametrize("make", [
    lambda: _llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    lambda: _llama(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
    lambda: _llama(hidden_act="gelu"),
    lambda: _llama().to(torch.float16),
    lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)),
], ids=["dynamic_rope", "yarn_rope", "gelu", "fp16", "qwen2"])
def test_unsupported_configs_fall_back(make):
    model = make()
    assert not lean_supported(model)
    assert type(make_runner(model, model.config.vocab_size, "auto")) is HFRunner
    with pytest.raises(ValueError):
        make_runner(model, model.config.vocab_size, "lean")


@pytest.mark.slow
def test_embedded_target_matches_hf():
    from common.models import EMBEDDED, load_model

    model = load_model(EMBEDDED)
    hf, lean = HFRunner(model, 49152), LeanRunner(model, 49152)
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(5))
    for chunk, num_logits in ((ids[:30], 2), (ids[30:31], 1), (ids[31:36], 5), (ids[36:], 4)):
        _close(lean.forward(chunk, num_logits), hf.forward(chunk, num_logits))
    prompt = ids[None, :20]
    assert (generate(model, prompt, max_new_tokens=32, backend="lean").tolist()
            == generate(model, prompt, max_new_tokens=32, backend="hf").tolist())
