"""RELIABILITY 24: draft/target tokenizer compatibility, padded embedding rows."""

import pytest
import torch

from common.errors import UserError
from common.models import TokenizerMismatch, check_tokenizers, load_tokenizer
from decode import generate, speculative_generate
from tests.conftest import small_llama


class FakeTokenizer:
    def __init__(self, vocab, eos=1):
        self.vocab, self.eos_token_id, self.bos_token_id, self.pad_token_id, self.unk_token_id = vocab, eos, 0, eos, None

    def get_vocab(self):
        return dict(self.vocab)


def test_same_size_different_vocabulary_is_refused():
    a = FakeTokenizer({"<s>": 0, "</s>": 1, "hello": 2, "world": 3})
    b = FakeTokenizer({"<s>": 0, "</s>": 1, "world": 2, "hello": 3})  # same size, ids swapped
    with pytest.raises(TokenizerMismatch, match="tokenizers differ"):
        check_tokenizers(a, b)


def test_different_special_tokens_are_refused():
    vocab = {"<s>": 0, "</s>": 1, "x": 2}
    with pytest.raises(TokenizerMismatch, match="eos_token_id"):
        check_tokenizers(FakeTokenizer(vocab, eos=1), FakeTokenizer(vocab, eos=2))


def test_mismatch_is_reported_as_a_user_error():
    assert issubclass(TokenizerMismatch, UserError)


def test_folder_without_tokenizer_files_is_named(tmp_path):
    """Not transformers' "You need to have sentencepiece or tiktoken installed"."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UserError, match=f"model folder '{tmp_path}' has no tokenizer files"):
        load_tokenizer(str(tmp_path))


def test_real_tokenizer_matches_itself():
    tok = load_tokenizer("tiny:target")
    check_tokenizers(tok, load_tokenizer("tiny:draft"))


def test_padded_embedding_rows_are_accepted_and_sliced():
    """A draft with extra (padded) vocabulary rows works: logits are cut to the shared vocabulary."""
    target = small_llama(vocab_size=16, seed=0, layers=2)
    padded = small_llama(vocab_size=24, seed=0, layers=2)
    with torch.no_grad():  # same weights on the shared rows, so greedy agreement is total
        for name, param in padded.named_parameters():
            source = dict(target.named_parameters())[name]
            param[tuple(slice(0, s) for s in source.shape)] = source
            if param.shape[0] == 24:
                param[16:] = 0
    prompt = torch.tensor([[0, 3, 7]])
    out = speculative_generate(target, padded, prompt, k=3, max_new_tokens=12)
    assert out.tokens.max() < 16
    assert out.tokens.tolist() == generate(target, prompt, max_new_tokens=12).tolist()
    assert out.stats.alpha == 1.0
