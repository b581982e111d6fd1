"""The feature draft (decode/drafts/feature/model.py): its training forward equals cached decoding, and it saves,
loads and checks its target."""

import pytest
import torch

from decode.drafts.feature.model import (FeatureDraft, FeatureDraftCache, FeatureDraftConfig, feature_draft_problem,
                                         is_feature_draft)
from tests.conftest import random_feature_draft, small_llama


CONFIG = FeatureDraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                            target_layers=[0, 1, 2], vocab_size=100, draft_vocab_size=20)


def test_unrolled_training_forward_equals_cached_decoding():
    """Step j of `unrolled` at position i is what decoding computes when the target verified up to i - j
    and the draft proposed the rest: a fresh cache fed the verified positions from the target's
    features, then j positions on its own outputs."""
    torch.manual_seed(0)
    model = FeatureDraft(CONFIG, torch.arange(20)).double()
    length, steps = 12, 4
    target_hidden = torch.randn(1, length, 3, 32, dtype=torch.double)
    embeds = torch.randn(1, length, 32, dtype=torch.double)
    outs = model.unrolled(target_hidden, embeds, steps)
    cache = FeatureDraftCache(model)
    for j in range(steps):
        for i in range(j, length):
            cache.reset()
            verified = i - j  # the target verified positions 0..verified
            last = cache.forward(model.fuse(target_hidden[0, : verified + 1]), embeds[0, : verified + 1])[-1]
            for position in range(verified + 1, i + 1):
                last = cache.forward(last[None], embeds[0, position : position + 1])[0]
            torch.testing.assert_close(last, outs[j][0, i], atol=1e-9, rtol=0)


def test_unrolled_steps_differ_from_the_first():
    """The check above has teeth: later steps read the draft's own outputs, not the target's."""
    torch.manual_seed(0)
    model = FeatureDraft(CONFIG, torch.arange(20))
    outs = model.unrolled(torch.randn(1, 8, 3, 32), torch.randn(1, 8, 32), 2)
    assert (outs[0][0, 1:] - outs[1][0, 1:]).abs().max() > 1e-3


def test_cache_rollback_recomputes_the_same_outputs():
    torch.manual_seed(1)
    model = FeatureDraft(CONFIG, torch.arange(20))
    hidden, embeds = torch.randn(6, 32), torch.randn(6, 32)
    cache = FeatureDraftCache(model)
    full = cache.forward(hidden, embeds)
    cache.rollback(3)
    torch.testing.assert_close(cache.forward(hidden[3:], embeds[3:]), full[3:], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(7)


def test_save_and_load_round_trip(tmp_path):
    target = small_llama(layers=2)
    draft = random_feature_draft(target, draft_ids=[0, 2, 4, 6, 8])
    assert feature_draft_problem(tmp_path / "draft") is not None
    draft.save(tmp_path / "draft")
    assert is_feature_draft(tmp_path / "draft") and feature_draft_problem(tmp_path / "draft") is None
    loaded = FeatureDraft.load(tmp_path / "draft")
    assert loaded.config == draft.config and loaded.config.target_num_layers == 2
    assert loaded.draft_ids.tolist() == [0, 2, 4, 6, 8]
    out = torch.randn(3, 32)
    torch.testing.assert_close(loaded.logits(out), draft.logits(out), atol=0, rtol=0)
    (tmp_path / "draft" / "model.safetensors").unlink()
    assert "has no model.safetensors" in feature_draft_problem(tmp_path / "draft")


@pytest.mark.parametrize("ids", [[0, 0, 1], [0, 1, 100], [-1, 0, 1]])
def test_draft_ids_must_be_distinct_target_ids(ids):
    config = FeatureDraftConfig(**{**CONFIG.__dict__, "draft_vocab_size": 3})
    with pytest.raises(ValueError, match=r"3 distinct target ids in \[0, 100\)"):
        FeatureDraft(config, torch.tensor(ids))
