"""llama.cpp's EAGLE-3 GGUF of a feature draft (distill/export/eagle3_gguf.py): read back, it holds the
EAGLE-3 checkpoint's weights under llama.cpp's names and layouts, and llama.cpp decodes with it (slow;
skipped where `make setup-llamacpp` has not built the tools)."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from common.models import EMBEDDED, embedded_gguf, load_model
from decode.engines.__main__ import main
from distill.export.eagle3 import Eagle3ExportError, eagle3_tensors
from distill.export.eagle3_gguf import GGUF_NAMES, write_eagle3_gguf
from distill.export.gguf import tokenizer_fields
from tests.conftest import random_feature_draft, small_llama


ROOT = Path(__file__).resolve().parent.parent
SUBSET_IDS = [0, 1, 2, 3, 5, 7, 9, 11, 13]


def llamacpp_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q or k rows as llama.cpp orders them: in each head, HF's dimension i (first half) and i + D/2 (second
    half) become neighbours 2i and 2i + 1."""
    head_dim = weight.shape[0] // n_heads
    order = [h * head_dim + (i // 2 if i % 2 == 0 else head_dim // 2 + i // 2)
             for h in range(n_heads) for i in range(head_dim)]
    return weight[order]


def read(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    return fields, {t.name: t for t in reader.tensors}


def test_gguf_holds_the_eagle3_checkpoint(tmp_path):
    target = small_llama(layers=5)
    draft = random_feature_draft(target, SUBSET_IDS, target_layers=(0, 2, 3))
    fields = tokenizer_fields(embedded_gguf())
    paths = write_eagle3_gguf(draft, target.config, fields, tmp_path / "out")
    assert [p.name for p in paths] == ["draft-f16.gguf", "draft-q8_0.gguf"]
    meta, tensors = read(paths[0])
    assert meta["general.architecture"] == "eagle3" and meta["eagle3.block_count"] == 1
    assert meta["eagle3.target_layers"] == [1, 3, 4]  # the layers whose input llama.cpp captures
    assert meta["eagle3.target_hidden_size"] == 32 and meta["eagle3.norm_before_fc"] is False
    assert meta["eagle3.vocab_size"] == 16 and meta["eagle3.attention.head_count_kv"] == 2
    assert all(meta[f.name] == f.value for f in fields)  # the target's tokenizer, as llama.cpp checks it
    assert set(tensors) == set(GGUF_NAMES.values()) and "token_embd.weight" not in tensors  # the target's is used
    assert np.array(tensors["d2t"].data).tolist() == SUBSET_IDS  # absolute target ids, not EAGLE-3's offsets
    checkpoint = eagle3_tensors(draft)
    heads = {"blk.0.attn_q.weight": 4, "blk.0.attn_k.weight": 2}
    for name, gguf_name in GGUF_NAMES.items():
        if name == "d2t":
            continue
        expected = checkpoint[name].float()
        if gguf_name in heads:
            expected = llamacpp_rows(expected, heads[gguf_name])
        stored = torch.from_numpy(np.array(tensors[gguf_name].data).astype(np.float32)).reshape(expected.shape)
        torch.testing.assert_close(stored, expected.half().float(), atol=0, rtol=0, msg=gguf_name)
    _, quantized = read(paths[1])
    assert quantized["fc.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert quantized["d2t"].tensor_type == gguf.GGMLQuantizationType.I64


def test_a_draft_not_reading_three_layers_is_refused(tmp_path):
    target = small_llama(layers=5)
    with pytest.raises(Eagle3ExportError, match="exactly three target layers; this draft reads 2"):
        write_eagle3_gguf(random_feature_draft(target, target_layers=(0, 2)), target.config, [], tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_llamacpp_decodes_with_the_eagle3_gguf(tmp_path):
    """A random EAGLE-3 draft for the embedded target, run by llama.cpp's draft-eagle3 mode through `make
    eval-engines` (the export folder holds only eagle3-gguf/, so engines.draft=auto picks it): the flags
    this build takes, what it prints, and greedy output equal to plain greedy."""
    tools = ROOT / ".llamacpp" / "bin"
    if not (tools / "llama-speculative-simple").is_file():
        pytest.skip("llama.cpp's tools are not built (make setup-llamacpp)")
    target = load_model(EMBEDDED)
    draft = random_feature_draft(target, list(range(2048)), target_layers=(1, 14, 26), init_std=0.02)
    (tmp_path / "export").mkdir()
    write_eagle3_gguf(draft, target.config, tokenizer_fields(embedded_gguf()), tmp_path / "export" / "eagle3-gguf")
    report = main(["--config", "configs/smollm2.yaml", f"engines.export_dir={tmp_path / 'export'}",
                   "engines.run=[llamacpp]", f"engines.llamacpp_bin={tools}", "engines.llamacpp_target=embedded",
                   "engines.threads=1", "engines.llamacpp_p_min=0",  # a random draft is never confident
                   "eval.prompts=[gsm8k]", "eval.num_prompts=1", "eval.max_new_tokens=8",
                   "eval.temperatures=[0.0]", f"eval.out_dir={tmp_path}"])
    rows = {r["mode"]: r for r in report["engines"]}
    assert set(rows) == {"plain", "eagle3", "ngram"} and all(r["tok_s"] > 0 for r in rows.values())
    assert rows["eagle3"]["greedy_identical"] is True and rows["eagle3"]["alpha"] is not None
