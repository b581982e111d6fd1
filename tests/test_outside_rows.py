"""Factored outside rows (distill.outside_rank, decode/vocab.py): each token outside a subset draft's rows gets
a logit of its own, the "other" row's plus U_j . (P h). The decoder, the runners, training and the
full-vocabulary exports must all see that one distribution, and decoding stays lossless with it."""

from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.config import ConfigError, load_config
from common.models import embedded_gguf, load_model, load_tokenizer
from common.outside_factors import FACTORS_NAME, OUTSIDE_FILE, MissingFactorsError
from decode.api import generate, speculative_generate
from decode.drafts.standalone.build import add_outside_rows, build_scratch_draft, choose_shape
from decode.runners import make_runner
from decode.runners.hf import HFRunner
from decode.vocab import VocabSubset
from distill import factored_buckets
from distill.export.gguf import tokenizer_fields, write_gguf_files
from distill.export.hf import export_hf
from distill.export.hf_full import full_vocab_model
from distill.factored_buckets import factored_topk_buckets
from distill.losses import topk_buckets
from distill.train import train
from distill.training.accelerator import shards_parameters
from tests.conftest import factored_llama, subset_llama
from tests.synthetic_shards import write_scored_shards


ROOT = Path(__file__).resolve().parents[1]
SUBSET_IDS = [0, 1, 2, 3, 5, 7, 9, 11, 13]
OUTSIDE_IDS = [4, 6, 8, 10, 12, 14, 15]
IDS = torch.tensor([0, 3, 7, 2, 9, 4, 12])  # outside ids read the "other" row


def full_logits(draft, ids: torch.Tensor = IDS) -> torch.Tensor:
    return make_runner(draft, 16).forward(ids, ids.shape[0])


def test_each_outside_token_has_the_logit_of_its_materialised_head_row():
    draft = factored_llama(SUBSET_IDS, 16, rank=3)
    subset = VocabSubset.of(draft)
    assert subset.factored and subset.head_rows == len(SUBSET_IDS) + 1 + 3
    assert subset.outside_ids.tolist() == OUTSIDE_IDS
    with torch.no_grad():
        hidden = draft.model(input_ids=subset.rows(IDS)[None]).last_hidden_state[0]  # [n, hidden]
        head = draft.lm_head.weight
        other, basis = head[len(SUBSET_IDS)], head[len(SUBSET_IDS) + 1:]
        expected = torch.empty(IDS.shape[0], 16)
        expected[:, SUBSET_IDS] = hidden @ head[: len(SUBSET_IDS)].T
        expected[:, OUTSIDE_IDS] = hidden @ (other + subset.outside_factors @ basis).T
    logits = full_logits(draft)
    assert torch.allclose(logits, expected, atol=1e-5)
    assert logits[:, OUTSIDE_IDS].std(-1).min() > 0.1  # not one shared "other" logit


def test_lean_and_hf_runners_and_the_full_vocabulary_export_agree():
    draft = factored_llama(SUBSET_IDS, 16, rank=2, seed=4)
    lean = full_logits(draft)
    assert torch.allclose(HFRunner(draft, 16).forward(IDS, IDS.shape[0]), lean, atol=1e-5)
    full = full_vocab_model(draft)
    assert full.config.vocab_size == 16 and not full.config.tie_word_embeddings
    assert VocabSubset.from_config(full.config) is None
    with torch.no_grad():
        assert torch.allclose(full(input_ids=IDS[None]).logits[0], lean, atol=1e-5)


def test_zero_factors_are_the_spread_draft():
    spread = subset_llama(SUBSET_IDS, 16, seed=2, spread_other=True)
    factored = subset_llama(SUBSET_IDS, 16, seed=2, spread_other=True)
    add_outside_rows(factored, rank=4, seed=0)
    assert VocabSubset.of(factored).head_rows == len(SUBSET_IDS) + 1 + 4
    assert getattr(factored, FACTORS_NAME).requires_grad and not getattr(factored, FACTORS_NAME).any()
    assert torch.allclose(full_logits(factored), full_logits(spread), atol=1e-6)  # a wider head GEMM: rounding
    with pytest.raises(ValueError, match="already has 4 factored outside rows, not 2"):
        add_outside_rows(factored, rank=2, seed=0)
    with pytest.raises(ValueError, match="spread_other=true"):
        add_outside_rows(subset_llama(SUBSET_IDS, 16), rank=2, seed=0)


def test_the_factors_are_saved_beside_the_weights_and_loaded_with_them(tmp_path):
    draft = factored_llama(SUBSET_IDS, 16, rank=3)
    folder = export_hf(draft, load_tokenizer("tiny:target"), tmp_path / "draft")
    assert FACTORS_NAME not in load_file(folder / "model.safetensors")  # HF tools see a plain Llama
    assert torch.equal(load_file(folder / OUTSIDE_FILE)[FACTORS_NAME], getattr(draft, FACTORS_NAME).detach())
    assert torch.equal(full_logits(load_model(str(folder))), full_logits(draft))
    (folder / OUTSIDE_FILE).unlink()
    with pytest.raises(MissingFactorsError, match=OUTSIDE_FILE):
        load_model(str(folder))
    with pytest.raises(ValueError, match="no outside_factors"):
        VocabSubset.of(AutoModelForCausalLM.from_pretrained(folder))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("backend", ["hf", "auto"])
def test_greedy_equals_target_only(pair, k, backend):
    target, _ = pair
    expected = generate(target, IDS[None], max_new_tokens=24, backend=backend)
    out = speculative_generate(target, factored_llama(SUBSET_IDS, 16), IDS[None], k=k, max_new_tokens=24,
                               backend=backend)
    assert out.tokens.tolist() == expected.tolist()


def test_gguf_holds_the_materialised_head_and_the_other_row_on_input(tmp_path):
    """Over the embedded tokenizer (llama.cpp checks it): output.weight is the factored head, token_embd gives
    outside ids the "other" row."""
    ids = sorted(set(range(0, 300)) | set(range(1000, 49152, 101)))
    subset = VocabSubset(ids, 49152, spread_other=True, outside_rank=2)
    draft = factored_llama(ids, 49152, rank=2)  # 32 wide: q8_0 blocks fit
    full = full_vocab_model(draft)
    write_gguf_files(full, tokenizer_fields(embedded_gguf()), tmp_path, "draft")
    tensors = {t.name: torch.from_numpy(t.data.copy()).float()
               for t in gguf.GGUFReader(tmp_path / "draft-f16.gguf").tensors}
    head, embed = full.lm_head.weight.detach(), full.model.embed_tokens.weight.detach()
    assert torch.allclose(tensors["output.weight"], head, atol=2e-3)
    assert torch.allclose(tensors["token_embd.weight"], embed, atol=2e-3)
    outside = subset.outside_ids[:50]
    assert torch.equal(embed[outside], draft.model.embed_tokens.weight[len(ids)].detach().expand(50, -1))
    assert head[outside].std(0).max() > 0  # each outside id its own head row


@pytest.mark.parametrize("peaked", [False, True])
def test_training_buckets_equal_those_of_the_full_vocabulary_logits(monkeypatch, peaked):
    """factored_topk_buckets (chunked, its own backward) against topk_buckets on the full logits with autograd:
    the same K + 1 buckets and gradients, with top-K entries inside and outside the subset, chunks of 7 outside
    columns and, peaked, the top-K entries inside the subset 25 nats above every other logit."""
    monkeypatch.setattr(factored_buckets, "CHUNK", 7)
    generator = torch.Generator().manual_seed(0)
    vocab, size, rank, positions, k = 60, 13, 3, 6, 5
    ids = sorted(torch.randperm(vocab, generator=generator)[:size].tolist())
    factors = torch.randn(vocab - size, rank, dtype=torch.float64, generator=generator, requires_grad=True)
    subset = VocabSubset(ids, vocab, spread_other=True, outside_rank=rank, outside_factors=factors)
    rows = torch.randn(positions, size + 1 + rank, dtype=torch.float64, generator=generator)
    topk_ids = torch.stack([torch.randperm(vocab, generator=generator)[:k] for _ in range(positions)])
    columns = subset.full_columns[topk_ids]
    if peaked:  # the top-K entries inside the subset far above every other logit
        position, entry = (columns < size).nonzero(as_tuple=True)
        rows[position, columns[position, entry]] += 25.0
    rows.requires_grad_(True)
    topk_logp = torch.log_softmax(torch.randn(positions, k, generator=generator), -1) - 0.01
    expected = topk_buckets(subset.full_logits(rows), topk_ids, topk_logp)
    got = factored_topk_buckets(rows, factors, columns, topk_logp, size)
    assert torch.allclose(got[0], expected[0], atol=1e-5) and torch.allclose(got[1], expected[1])
    weights = torch.randn(positions, k + 1, generator=generator)
    want = torch.autograd.grad((expected[0] * weights).sum(), [rows, factors])
    have = torch.autograd.grad((got[0] * weights).sum(), [rows, factors])
    for a, b in zip(have, want):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_shape_search_counts_the_factors():
    from tests.test_draft import SMOLLM2, SMOLLM2_PARAMS

    plain_config, plain = choose_shape(SMOLLM2, SMOLLM2_PARAMS, 0.02, 2, 8193)
    factors = (49152 - 8192) * 8
    config, shape = choose_shape(SMOLLM2, SMOLLM2_PARAMS, 0.02, 2, 8193 + 8, factors)
    budget = 0.02 * SMOLLM2_PARAMS
    assert config.hidden_size <= plain_config.hidden_size
    assert abs(shape.params - budget) <= abs(plain.params + factors - budget)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_scored_shards(tmp_path_factory.mktemp("data"), load_model("tiny:target"))


def tiny_run(data, out, *overrides):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    config = load_config(ROOT / "configs/tiny.yaml", [f"distill.data_dirs=[{data}]", f"distill.out_dir={out}",
                                                      "wandb.mode=disabled", "distill.max_steps=3",
                                                      "distill.eval_every=0", *overrides])
    return train(config)


@pytest.mark.parametrize("teacher", ["cached", "online"])
def test_training_moves_the_factors_and_the_export_gives_the_native_distribution(data, tmp_path, teacher):
    """From scratch with outside_rank, with either teacher: training moves the factors, and the run's
    full-vocabulary export (export/hf) equals the native draft over the full vocabulary."""
    summary = tiny_run(data, tmp_path / "run", "distill.outside_rank=4", "distill.export=true",
                       f"distill.teacher={teacher}")
    assert 0 < summary["final/alpha"] <= 1
    native = load_model(str(tmp_path / "run/final"))
    subset = VocabSubset.of(native)
    assert subset.outside_rank == 4 and subset.head_rows == 512 + 1 + 4
    # The run's draft at step 0: the same target, subset, shape and seed (configs/tiny.yaml).
    start, _ = build_scratch_draft(load_model("tiny:target"), 0.03, 1, VocabSubset(
        subset.ids, 49152, spread_other=True, outside_rank=4), "target", seed=0)
    moved = (subset.outside_factors - getattr(start, FACTORS_NAME)).abs().max()
    assert 1e-4 < moved < 1  # three AdamW steps of lr 3e-3 moved them
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run/export/hf").eval()
    ids = torch.tensor([1, 504, 3458, 314, 253, 1345, 30, 2])
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids[None]).logits[0],
                              make_runner(native, 49152).forward(ids, ids.shape[0]), atol=1e-4)


def test_continuing_a_spread_draft_with_factors_starts_from_its_distribution(data, tmp_path):
    tiny_run(data, tmp_path / "spread")
    tiny_run(data, tmp_path / "more", f"distill.init={tmp_path / 'spread/final'}", "distill.vocab_subset=0",
             "distill.outside_rank=2", "distill.max_steps=1", "distill.lr=1e-9", "distill.warmup_steps=1")
    before, after = load_model(str(tmp_path / "spread/final")), load_model(str(tmp_path / "more/final"))
    assert VocabSubset.of(after).outside_rank == 2
    ids = torch.tensor([1, 504, 3458, 314, 253])
    assert torch.allclose(make_runner(after, 49152).forward(ids, 5), make_runner(before, 49152).forward(ids, 5),
                          atol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    (["distill.outside_rank=-1"], "must be >= 0"),
    (["distill.outside_rank=4", "distill.vocab_subset=0"], "vocab_subset > 0"),
    (["distill.outside_rank=4", "distill.spread_other=false"], "spread_other=true"),
    (["distill.outside_rank=4", "distill.draft_kind=feature", "distill.teacher=online"], "draft_kind=standalone"),
    (["distill.outside_rank=4", "distill.loss={forward_kl: 1.0, ce: 0.1}"], "'ce' is not built"),
    (["distill.outside_rank=4", "distill.deepspeed_config=configs/deepspeed_zero3.json"], "not built for ZeRO-3"),
])
def test_bad_outside_rank_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs/tiny.yaml", overrides)


@pytest.mark.parametrize("kind, stage, shards", [("FSDP", None, True), ("DEEPSPEED", 3, True),
                                                 ("DEEPSPEED", 2, False), ("MULTI_CPU", None, False)])
def test_sharded_training_is_recognised(kind, stage, shards):
    """FSDP comes from accelerate's own config file, not ours: the recipe asks the accelerator (and refuses
    outside_rank there) before any model loads."""
    plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(name=kind),
                                  state=SimpleNamespace(deepspeed_plugin=plugin))
    assert shards_parameters(accelerator) == shards
