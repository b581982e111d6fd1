"""Exports serving engines load (distill/export/): hf-full and gguf from a subset draft over the
embedded tokenizer, and the bad inputs refused without a half-written output."""

import json
import math
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from common.models import TokenizerMismatch, embedded_gguf, load_model, load_tokenizer
from decode.hf_baselines import hf_generate
from decode.runners import make_runner
from decode.vocab import VocabSubset
from distill.export.gguf import GGUFExportError, write_gguf_files
from distill.export.gguf_metadata import GGUFMetadataError, read_metadata
from distill.export.hf_full import LossyExportError
from distill.export.run import ExportOptions, IncompleteDraftError, OutputInUseError, export_run
from tests.conftest import run_as_main


ROOT = Path(__file__).resolve().parents[1]
FULL_VOCAB = 49152
# A few hundred ids the tiny target likes plus the special ones: outside tokens stay likely enough
# for the "other" row to matter.
SUBSET_IDS = sorted(set(range(0, 400)) | set(range(1000, 49152, 97)))
PROMPT = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 2]])


def subset_draft(spread_other: bool = True, seed: int = 3) -> LlamaForCausalLM:
    """A tiny subset draft over the embedded tokenizer (rows 32 wide: q8_0 blocks fit)."""
    config = LlamaConfig(vocab_size=len(SUBSET_IDS) + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    VocabSubset(SUBSET_IDS, FULL_VOCAB, spread_other=spread_other).write_to(config)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def make_run(root: Path, draft, tokenizer=None) -> Path:
    """A run folder whose final/ holds `draft`, as `make distill` leaves it."""
    final = root / "final"
    draft.save_pretrained(final)
    (tokenizer or load_tokenizer("tiny:target")).save_pretrained(final)
    (final / "config.yaml").write_text("target: tiny:target\n")
    return root


@pytest.fixture(scope="module")
def spread_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    return make_run(root, subset_draft())


@pytest.fixture(scope="module")
def hf_full(spread_run, tmp_path_factory):
    return export_run(spread_run, tmp_path_factory.mktemp("x") / "hf-full", "hf-full")


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits[0].float()


def test_the_spread_flag_travels_in_the_config_and_old_drafts_keep_theirs():
    config = LlamaConfig()
    VocabSubset([1, 5], 9, spread_other=True).write_to(config)
    subset = VocabSubset.from_config(config)
    assert subset.spread_other and subset.other_log_count == pytest.approx(math.log(7))
    assert subset.token_ids(torch.tensor([0, 2])).tolist() == [1, 0]  # "other": the first outside id
    del config.draft_spread_other  # a draft saved before the flag existed
    assert not VocabSubset.from_config(config).spread_other
    VocabSubset.remove_from(config)
    assert VocabSubset.from_config(config) is None


def test_hf_full_gives_the_native_full_vocabulary_logits(spread_run, hf_full):
    exported = AutoModelForCausalLM.from_pretrained(hf_full).eval()
    assert exported.config.vocab_size == FULL_VOCAB and VocabSubset.from_config(exported.config) is None
    assert not hasattr(exported.config, "draft_vocab_ids")
    draft = AutoModelForCausalLM.from_pretrained(spread_run / "final").eval()
    runner = make_runner(draft, FULL_VOCAB)
    native = runner.forward(PROMPT[0], PROMPT.shape[1])  # [n, V]: the "other" logit at each outside id
    assert torch.allclose(logits_of(exported, PROMPT), native, atol=1e-5)
    assert AutoTokenizer.from_pretrained(hf_full).get_vocab() == load_tokenizer("tiny:target").get_vocab()
    assert json.loads((hf_full / "export.json").read_text())["format"] == "hf-full"


def test_hf_assisted_generation_with_the_export_is_plain_greedy(hf_full):
    target = load_model("tiny:target")
    assistant = AutoModelForCausalLM.from_pretrained(hf_full).eval()
    plain = hf_generate(target, PROMPT, 12, eos_token_id=2)
    assisted = hf_generate(target, PROMPT, 12, eos_token_id=2, assistant=assistant, k=3)
    assert assisted.tolist() == plain.tolist()


def test_gguf_reads_back_with_the_export_logits_and_the_target_tokenizer(spread_run, hf_full, tmp_path):
    out = export_run(spread_run, tmp_path / "gguf", "gguf")
    assert sorted(p.name for p in out.glob("*.gguf")) == ["draft-f16.gguf", "draft-q8_0.gguf"]
    expected = logits_of(AutoModelForCausalLM.from_pretrained(hf_full).eval(), PROMPT)
    for name, atol in (("draft-f16.gguf", 2e-2), ("draft-q8_0.gguf", 1e-1)):
        loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=name, dtype=torch.float32).eval()
        got = logits_of(loaded, PROMPT)
        assert (got - expected).abs().max() < atol, name
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), name
    # llama.cpp compares the draft's tokenizer with the target's: every `tokenizer.*` field is copied as it was.
    target_fields, draft_fields = read_metadata(embedded_gguf()), read_metadata(out / "draft-f16.gguf")
    tokenizer_keys = [k for k in target_fields if k.startswith("tokenizer.")]
    assert len(tokenizer_keys) > 5 and tokenizer_keys == [k for k in draft_fields if k.startswith("tokenizer.")]
    assert all(draft_fields[k] == target_fields[k] for k in tokenizer_keys)
    assert len(draft_fields["tokenizer.ggml.tokens"].value) == FULL_VOCAB


def test_metadata_reader_reads_what_the_gguf_library_reads(tmp_path):
    """distill/export/gguf_metadata.py against gguf.GGUFReader on a file holding every value type."""
    path, kinds = tmp_path / "kinds.gguf", gguf.GGUFValueType
    writer = gguf.GGUFWriter(path, "llama")
    scalars = {kinds.UINT8: 200, kinds.INT8: -3, kinds.UINT16: 60000, kinds.INT16: -300, kinds.UINT32: 2**31,
               kinds.INT32: -2**30, kinds.FLOAT32: 0.25, kinds.BOOL: True, kinds.UINT64: 2**40,
               kinds.INT64: -2**40, kinds.FLOAT64: 1e-300, kinds.STRING: "Ġthe ü 日本"}
    for kind, value in scalars.items():
        writer.add_key_value(f"x.{kind.name.lower()}", value, kind)
        writer.add_key_value(f"x.{kind.name.lower()}s", [value] * 3, kinds.ARRAY, sub_type=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    library = {k: f for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    ours = read_metadata(path)
    assert list(ours) == list(library) and len(ours) == 2 * len(scalars) + 1  # + general.architecture
    for key, field in ours.items():
        types = library[key].types
        assert field.value == library[key].contents(), key
        assert (field.type, field.item_type) == (types[0], types[-1] if len(types) > 1 else None), key


def test_metadata_of_a_file_that_is_not_gguf_is_one_error(tmp_path):
    (tmp_path / "draft.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFMetadataError, match="not a GGUF file"):
        read_metadata(tmp_path / "draft.gguf")


def test_old_subset_draft_is_refused_unless_lossy_acceptance_is_accepted(tmp_path):
    run = make_run(tmp_path / "run", subset_draft(spread_other=False))
    with pytest.raises(LossyExportError, match="--lossy-acceptance"):
        export_run(run, tmp_path / "out", "hf-full")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".tmp-out").exists()
    out = export_run(run, tmp_path / "out", "hf-full", options=ExportOptions(lossy_acceptance=True))
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == FULL_VOCAB


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    tokenizer = load_tokenizer("tiny:target")
    tokenizer.add_tokens(["<not-in-the-target>"])
    run = make_run(tmp_path / "run", subset_draft(), tokenizer)
    with pytest.raises(TokenizerMismatch, match="tokenizers differ"):
        export_run(run, tmp_path / "out", "hf-full")
    assert not (tmp_path / "out").exists()


def test_an_incomplete_draft_folder_is_refused(tmp_path):
    run = make_run(tmp_path / "run", subset_draft())
    (run / "final" / "model.safetensors").unlink()
    with pytest.raises(IncompleteDraftError, match="missing model.safetensors"):
        export_run(run, tmp_path / "out", "hf-full")
    with pytest.raises(IncompleteDraftError, match="does not exist"):
        export_run(run, tmp_path / "out", "hf-full", source="best")
    assert not (tmp_path / "out").exists()


def test_an_output_holding_another_draft_is_refused_and_kept(spread_run, hf_full, tmp_path):
    other = make_run(tmp_path / "other", subset_draft(seed=4))
    before = (hf_full / "model.safetensors").read_bytes()
    with pytest.raises(OutputInUseError, match="export of another draft"):
        export_run(other, hf_full, "hf-full")
    assert (hf_full / "model.safetensors").read_bytes() == before
    export_run(spread_run, hf_full, "hf-full")  # the same draft again: replaced
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(OutputInUseError, match="not an export"):
        export_run(spread_run, tmp_path / "notes", "hf")


def test_an_export_of_the_same_run_trained_further_is_replaced(tmp_path):
    run = make_run(tmp_path / "run", subset_draft(seed=5))
    out = export_run(run, tmp_path / "out", "hf-full")
    before = (out / "model.safetensors").read_bytes()
    make_run(tmp_path / "run", subset_draft(seed=6))  # the same run folder, a newer draft
    export_run(run, out, "hf-full")
    assert (out / "model.safetensors").read_bytes() != before


def test_a_failed_write_leaves_nothing_behind(spread_run, tmp_path, monkeypatch):
    def failing(model, fields, folder, name):
        write_gguf_files(model, fields, folder, name)
        raise RuntimeError("killed mid-export")

    monkeypatch.setattr("distill.export.run.write_gguf_files", failing)
    with pytest.raises(RuntimeError, match="killed"):
        export_run(spread_run, tmp_path / "gguf", "gguf")
    assert not (tmp_path / "gguf").exists()


def test_gguf_of_another_target_needs_its_gguf(tmp_path):
    target_dir = tmp_path / "target"
    load_tokenizer("tiny:target").save_pretrained(target_dir)
    run = make_run(tmp_path / "run", subset_draft())
    with pytest.raises(GGUFExportError, match="--target-gguf"):
        export_run(run, tmp_path / "out", "gguf", target=str(target_dir))


def test_cli_reports_a_bad_export_in_one_line(tmp_path, capsys):
    stderr = run_as_main("distill.export", "--run", str(tmp_path), "--out", str(tmp_path / "out"), "--format",
                         "hf-full", capsys=capsys)
    assert stderr.strip().startswith("error:") and "does not exist" in stderr and "\n" not in stderr.strip()
