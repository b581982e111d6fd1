"""distill/held_out.py: exact held-out acceptance against the target over the whole vocabulary."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import ConfigError
from common.models import load_model, load_tokenizer
from decode.stats import expected_tau
from distill.data import Example, collate, held_out_subset, load_examples
from distill.held_out import main
from distill.held_out_acceptance import draft_full_logits, held_out_acceptance
from tests.conftest import small_llama, subset_llama
from tests.synthetic_shards import write_scored_shards


ROOT = Path(__file__).resolve().parents[1]


def test_acceptance_is_the_overlap_of_the_two_full_distributions(tmp_path):
    """A draft identical to the target accepts everything; a spread subset draft is compared through its
    full-vocabulary expansion, exactly as a hand computation over the whole vocabulary gives."""
    target = small_llama(vocab_size=16, seed=0)
    draft = subset_llama([1, 3, 4, 7, 9], 16, seed=2, spread_other=True)
    ids = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 4:] = True
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    results = held_out_acceptance(target, {"same": target, "subset": draft}, [batch], [1.0, 0.5], tau_k=4)
    assert results["same"]["alpha_T1"] == pytest.approx(1.0) and results["same"]["alpha_greedy"] == 1.0
    assert results["same"]["tau_k4_T0.5"] == pytest.approx(5.0)
    with torch.no_grad():
        p = target(input_ids=ids).logits[mask].float()
        q = draft_full_logits(draft, batch)
    assert q.shape == p.shape and torch.isfinite(q).all()
    for T in (1.0, 0.5):
        expected = torch.minimum(torch.softmax(p / T, -1), torch.softmax(q / T, -1)).sum(-1).mean()
        assert results["subset"][f"alpha_T{T:g}"] == pytest.approx(float(expected), rel=1e-5)
    assert results["subset"]["tau_k4_T1"] == pytest.approx(expected_tau(results["subset"]["alpha_T1"], 4))
    assert results["subset"]["alpha_greedy"] == pytest.approx(float((q.argmax(-1) == p.argmax(-1)).float().mean()))
    in_head = torch.tensor([1, 3, 4, 7, 9])  # the target's mass and argmaxes on the subset's tokens
    assert results["subset"]["head_mass"] == pytest.approx(float(torch.softmax(p, -1)[:, in_head].sum(-1).mean()))
    assert results["subset"]["head_greedy"] == pytest.approx(float(torch.isin(p.argmax(-1), in_head).float().mean()))
    assert results["same"]["head_mass"] == pytest.approx(1.0) and results["same"]["head_greedy"] == 1.0


def test_the_command_compares_drafts_on_the_held_out_rows_training_uses(tmp_path, capsys):
    data = write_scored_shards(tmp_path / "data", load_model("tiny:target"))
    for name, ref in (("target", "tiny:target"), ("draft", "tiny:draft")):
        load_model(ref).save_pretrained(tmp_path / name)
        load_tokenizer(ref).save_pretrained(tmp_path / name)
    out = tmp_path / "results.json"
    results = main(["--config", str(ROOT / "configs/tiny.yaml"), "--drafts", str(tmp_path / "target"),
                    str(tmp_path / "draft"), "--json", str(out), f"distill.data_dirs=[{data}]"])
    _, held_out = load_examples([str(data)], 128, need_topk=False)
    assert len(held_out) > 4  # tiny.yaml's eval_samples: the command reads a spread subset
    tokens = int(collate(held_out_subset(held_out, 4), 0, with_topk=False)["loss_mask"].sum())
    assert results[str(tmp_path / "target")]["alpha_T1"] == pytest.approx(1.0)
    draft = results[str(tmp_path / "draft")]
    assert 0 < draft["alpha_T0.7"] < 1 and draft["tokens"] == tokens
    assert json.loads(out.read_text()) == results and "| draft | α T1 |" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--drafts: model path .* does not exist"):
        main(["--config", str(ROOT / "configs/tiny.yaml"), "--drafts", str(tmp_path / "nothing")])


def test_the_held_out_subset_spreads_over_each_folder_in_folder_order():
    def rows(folder, n):
        return [Example(np.arange(i + 2), 1, None, None, "x", folder) for i in range(n)]  # length-sorted

    first, second = rows(0, 10), rows(1, 6)
    spread = held_out_subset(first + second, 4)
    assert [len(ex.ids) for ex in spread] == [2, 5, 8, 11]  # shortest and longest kept, not the first four
    assert held_out_subset(first + second, 13) == first + [second[0], second[2], second[5]]
    assert held_out_subset(first + second, 100) == first + second
    assert held_out_subset(first, 0) == [] and held_out_subset(first, 1) == [first[0]]
