import os
import runpy
import sys
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.outside_factors import attach_outside_factors
from decode.drafts.feature.model import FeatureDraft, FeatureDraftConfig
from decode.vocab import VocabSubset


os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `make test` runs one pytest-xdist worker per core (at most 4): each worker, and every process a test
# starts, takes its share of the cores, since oversubscribed OpenMP threads make training-sized work
# many times slower.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, torch.get_num_threads()) // WORKERS)
torch.set_num_threads(THREADS)
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)


def small_llama(vocab_size: int = 16, hidden: int = 32, layers: int = 1, seed: int = 0,
                init_std: float = 0.3, max_positions: int = 256, tie: bool = False) -> LlamaForCausalLM:
    """A tiny random Llama with a small vocabulary. A large init_std makes its next-token
    distributions peaked and context dependent, so χ² tests have something to detect."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, initializer_range=init_std,
                         tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def subset_llama(vocab_ids: list[int], full_vocab_size: int, seed: int = 1,
                 spread_other: bool = False) -> LlamaForCausalLM:
    """A vocabulary-subset draft: rows for `vocab_ids` plus the "other" row (see decode/vocab.py);
    spread_other: the "other" logit is each outside token's (new drafts), else the outside mass."""
    draft = small_llama(vocab_size=len(vocab_ids) + 1, seed=seed)
    VocabSubset(vocab_ids, full_vocab_size, spread_other=spread_other).write_to(draft.config)
    return draft


def factored_llama(vocab_ids: list[int], full_vocab_size: int, rank: int = 3, seed: int = 1) -> LlamaForCausalLM:
    """A spread subset draft with factored outside rows (decode/vocab.py): r basis rows after "other" and random
    factors U, so every outside token has a logit of its own."""
    subset = VocabSubset(vocab_ids, full_vocab_size, spread_other=True, outside_rank=rank)
    draft = small_llama(vocab_size=subset.head_rows, seed=seed)
    subset.write_to(draft.config)
    generator = torch.Generator().manual_seed(seed)
    attach_outside_factors(draft, torch.randn(len(subset.outside_ids), rank, generator=generator))
    return draft.eval()


def random_feature_draft(target: LlamaForCausalLM, draft_ids: list[int] | None = None, target_layers=(0, 1),
                         seed: int = 5, init_std: float = 0.3) -> FeatureDraft:
    """A random feature draft for `target` over `draft_ids` (default: every id). Weights ~ N(0, init_std)
    as small_llama's, so its distributions are peaked and depend on what it reads."""
    ids = list(range(target.config.vocab_size)) if draft_ids is None else draft_ids
    config = FeatureDraftConfig.for_target(target.config, list(target_layers), intermediate_size=2 * target.config.hidden_size,
                                           draft_vocab_size=len(ids))
    torch.manual_seed(seed)
    draft = FeatureDraft(config, torch.tensor(ids))
    with torch.no_grad():
        for name, weight in draft.named_parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, init_std)
    return draft.eval()


class NegatedLlama(LlamaForCausalLM):
    """A draft whose greedy choice is never the target's: it returns the target's logits negated."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = -out.logits
        return out


def negated_copy(model: LlamaForCausalLM) -> NegatedLlama:
    neg = NegatedLlama(model.config)
    neg.load_state_dict(model.state_dict())
    return neg.eval()


@pytest.fixture
def one_thread():
    """One torch thread in this process: with two busy cores, OpenMP oversubscription makes
    training-sized work ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def pair():
    """(target, different draft) with a 16-token vocabulary."""
    return small_llama(seed=0, layers=2), small_llama(seed=1)


def run_as_main(module: str, *argv: str, capsys) -> str:
    """`python -m module argv...` without a new interpreter (importing torch and transformers again is
    ~8 s of a 2-core CPU): asserts exit code 2 and returns what it printed on stderr."""
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(sys, "argv", [module, *argv])
        warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 2
    return capsys.readouterr().err
