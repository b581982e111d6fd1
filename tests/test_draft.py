"""Draft construction: sizing, vocabulary subsets, embedding projection, decoding a subset draft."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.models import load_model, param_count
from decode import generate, speculative_generate
from decode.drafts.standalone.build import build_scratch_draft, choose_shape, project_embeddings, select_vocab
from decode.vocab import VocabSubset


# SmolLM2-135M-Instruct's shape (docs: ASSETS.md), counted on the meta device: no weights needed.
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                      max_position_embeddings=8192)
SMOLLM2_PARAMS = 134_515_008


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("vocab_rows,ratio", [(49152, 0.02), (8193, 0.02), (8193, 0.01)])
def test_draft_size_hits_the_ratio(vocab_rows, ratio):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside 1-3%: no warning
        config, shape = choose_shape(SMOLLM2, SMOLLM2_PARAMS, ratio, num_layers=2, vocab_rows=vocab_rows)
    assert abs(shape.ratio - ratio) / ratio < 0.3, shape
    assert config.num_attention_heads * config.head_dim == config.hidden_size
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert shape.num_layers == 2 and config.tie_word_embeddings


def test_draft_size_outside_usual_range_warns():
    with pytest.warns(UserWarning, match="outside the usual 1-3%"):
        choose_shape(SMOLLM2, SMOLLM2_PARAMS, 0.06, num_layers=2, vocab_rows=8193)


def test_select_vocab_keeps_specials_and_most_frequent():
    counts = torch.zeros(100, dtype=torch.long)
    counts[[10, 20, 30, 40]] = torch.tensor([5, 50, 7, 1])
    ids = select_vocab(counts, 4, always=[2, 0])
    assert ids == [0, 2, 20, 30]
    subset = VocabSubset(ids, 100)
    assert subset.input_rows[20] == 2 and subset.input_rows[99] == 4  # outside -> "other" row N
    assert subset.output_rows[99] == -1 and subset.output_rows[30] == 3


def test_embedding_projection_preserves_inner_products():
    embed = torch.randn(300, 24) @ torch.randn(24, 24)
    rows = torch.arange(0, 300, 3)
    out = project_embeddings(embed, 24, rows, 0.02, torch.Generator().manual_seed(0))
    assert out.shape == (101, 24)  # 100 subset rows + "other"
    chosen = embed[rows]
    assert torch.allclose(out[:100] @ out[:100].T, chosen @ chosen.T, rtol=1e-3, atol=1e-2)
    narrow = project_embeddings(embed, 8, None, 0.02, torch.Generator().manual_seed(0))
    assert narrow.shape == (300, 8)


def test_subset_draft_loads_through_decode_and_is_lossless(tmp_path):
    target = load_model("tiny:target")
    counts = torch.zeros(49152, dtype=torch.long)
    counts[300:700] = 1  # the subset: ids 300..699 (+ specials)
    ids = select_vocab(counts, 420, always=[0, 1, 2])
    draft, shape = build_scratch_draft(target, 0.03, 1, VocabSubset(ids, 49152), "target", seed=0)
    assert shape.vocab_rows == 421
    draft.save_pretrained(tmp_path / "draft")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    subset = VocabSubset.from_config(loaded.config)
    assert subset.ids.tolist() == ids and subset.full_vocab_size == 49152
    assert param_count(loaded) == shape.params
    prompt = torch.tensor([[1, 400, 401, 402, 350]])
    expected = generate(target, prompt, max_new_tokens=10, backend="hf")
    for k in (1, 3):
        out = speculative_generate(target, loaded, prompt, k=k, max_new_tokens=10, backend="hf")
        assert out.tokens.tolist() == expected.tolist()
