"""The EAGLE-3 export of a feature draft (distill/export/eagle3.py): read back the way vLLM reads it, it
is the same draft; the run-level export refuses the wrong draft kind for a format."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from common.errors import UserError
from common.models import load_model
from decode.drafts.feature.model import FeatureDraft, FeatureDraftCache, FeatureDraftConfig
from distill.export.eagle3 import Eagle3ExportError, write_eagle3
from distill.export.run import export_run
from tests.conftest import random_feature_draft, small_llama


SUBSET_IDS = [0, 1, 2, 3, 5, 7, 9, 11, 13]
# vLLM's llama_eagle3 names (after its "midlayer." -> "layers.0." mapping) -> this project's.
FROM_EAGLE3 = {
    "fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
    "midlayer.input_layernorm.weight": "embed_norm.weight", "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight": "post_norm.weight",
    **{f"midlayer.self_attn.{p}.weight": f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{f"midlayer.mlp.{p}.weight": f"{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}


def read_eagle3(folder) -> tuple[FeatureDraft, dict]:
    """A FeatureDraft from an EAGLE-3 folder, reading what vLLM reads: aux ids = layer inputs (our output
    ids + 1), row r = token r + d2t[r], the head and layer weights under its names."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    draft_vocab = config["draft_vocab_size"]
    ids = torch.arange(draft_vocab) + tensors["d2t"]
    assert tensors["t2d"].nonzero()[:, 0].tolist() == sorted(ids.tolist())
    ours = FeatureDraftConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        target_layers=[i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]],
        vocab_size=config["vocab_size"], draft_vocab_size=draft_vocab)
    draft = FeatureDraft(ours, ids)
    draft.load_state_dict({FROM_EAGLE3[name]: t for name, t in tensors.items() if name in FROM_EAGLE3}
                          | {"draft_ids": ids})
    assert set(tensors) == set(FROM_EAGLE3) | {"d2t", "t2d"}  # no embed_tokens: the target's is shared
    return draft.eval(), config


def full_vocab_logits(draft: FeatureDraft, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] (-inf outside the head's rows, as vLLM's compute_logits) after a cached forward."""
    out = FeatureDraftCache(draft).forward(draft.fuse(hidden), embeds)
    full = torch.full((out.shape[0], draft.config.vocab_size), float("-inf"))
    full[:, draft.draft_ids] = draft.logits(out)
    return full


def test_export_reads_back_as_the_same_draft(tmp_path):
    target = small_llama(layers=5)
    draft = random_feature_draft(target, SUBSET_IDS, target_layers=(0, 2, 3))
    write_eagle3(draft, target.config, tmp_path / "eagle3")
    loaded, config = read_eagle3(tmp_path / "eagle3")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM: layer inputs
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang: layer outputs
    assert loaded.draft_ids.tolist() == SUBSET_IDS
    hidden, embeds = torch.randn(7, 3, 32), torch.randn(7, 32)
    torch.testing.assert_close(full_vocab_logits(loaded, hidden, embeds), full_vocab_logits(draft, hidden, embeds),
                               atol=0, rtol=0)
    hf = AutoConfig.from_pretrained(tmp_path / "eagle3")  # transformers reads it as a one-layer Llama
    assert hf.model_type == "llama" and hf.rope_parameters["rope_theta"] == draft.config.rope_theta
    assert hf.draft_vocab_size == len(SUBSET_IDS) and hf.vocab_size == 16


def test_a_draft_reading_the_last_layer_is_refused(tmp_path):
    target = small_llama(layers=3)
    with pytest.raises(Eagle3ExportError, match=r"last layer \(2\)"):
        write_eagle3(random_feature_draft(target, target_layers=(0, 2)), target.config, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def feature_run(root, target_layers=(0,)):
    """A run folder whose final/ holds a feature draft for tiny:target (2 layers: only layer 0 is
    exportable, the last one is read after the final norm)."""
    draft = random_feature_draft(load_model("tiny:target"), draft_ids=list(range(0, 49152, 97)),
                                 target_layers=target_layers)
    draft.save(root / "final")
    (root / "final" / "config.yaml").write_text("target: tiny:target\n")
    return root, draft


def test_run_export_writes_eagle3_and_refuses_other_formats(tmp_path):
    run, draft = feature_run(tmp_path / "run")
    out = export_run(run, tmp_path / "exports" / "eagle3", "eagle3")  # parent folders made as needed
    loaded, _ = read_eagle3(out)
    assert (out / "config.yaml").is_file() and json.loads((out / "export.json").read_text())["format"] == "eagle3"
    torch.testing.assert_close(loaded.lm_head.weight, draft.lm_head.weight, atol=0, rtol=0)
    with pytest.raises(UserError, match="holds a feature draft, which exports as eagle3, eagle3-gguf, not 'hf-full'"):
        export_run(run, tmp_path / "out2", "hf-full")


def test_run_export_refuses_a_draft_for_another_target(tmp_path):
    run, _ = feature_run(tmp_path / "run")
    (run / "final" / "config.yaml").write_text("target: tiny:draft\n")
    with pytest.raises(UserError, match="hidden size 64 vs the target's 32"):
        export_run(run, tmp_path / "out", "eagle3")
    assert not (tmp_path / "out").exists()


def test_run_export_refuses_eagle3_for_a_standalone_draft(tmp_path):
    final = tmp_path / "run" / "final"
    small_llama().save_pretrained(final)
    (final / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="holds a standalone draft, which exports as hf, hf-full, gguf, not 'eagle3'"):
        export_run(tmp_path / "run", tmp_path / "out", "eagle3")
