"""Prompt sources, chat template, de-duplication, bad-prompt reporting and the train/eval split."""

import json

import pytest

from decode.models import load_tokenizer
from decode.prompts import build_prompt_set, load_prompt_set, read_texts, split_of


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny:target")


def test_embedded_sources_load_and_split_deterministically(tokenizer):
    a = build_prompt_set(["embedded"], tokenizer, eval_fraction=0.1)
    b = build_prompt_set(["embedded"], tokenizer, eval_fraction=0.1)
    for part in ("persistbench", "freshqa", "writingbench", "gsm8k"):
        assert a.counts[part]["kept"] > 0, part
    # 500 persistbench + 600 FreshQA + 1319 GSM8K + the short English WritingBench tasks.
    assert len(a.prompts) > 2400
    assert [(p.prompt_id, p.split, p.token_ids) for p in a.prompts] == [
        (p.prompt_id, p.split, p.token_ids) for p in b.prompts]
    train = {p.prompt_id for p in a.prompts if p.split == "train"}
    held_out = {p.prompt_id for p in a.prompts if p.split == "eval"}
    assert train and held_out and not train & held_out
    assert 0.07 < len(held_out) / len(a.prompts) < 0.13
    assert len({p.prompt_id for p in a.prompts}) == len(a.prompts)


def test_split_of_a_prompt_does_not_depend_on_the_set(tokenizer):
    full = {p.prompt_id: p.split for p in build_prompt_set(["gsm8k"], tokenizer).prompts}
    few = build_prompt_set(["gsm8k"], tokenizer, max_prompts=50).prompts
    assert len(few) == 50 and all(full[p.prompt_id] == p.split for p in few)
    assert split_of("abc", 0.0) == "train"


def test_chat_template_wraps_the_text(tokenizer):
    prompt = build_prompt_set(["freshqa"], tokenizer, max_prompts=1).prompts[0]
    text = tokenizer.decode(prompt.token_ids)
    assert prompt.text in text
    assert text.endswith("<|im_start|>assistant\n")
    with_system = build_prompt_set(["freshqa"], tokenizer, max_prompts=1, system_prompt="Be brief.").prompts[0]
    assert "Be brief." in tokenizer.decode(with_system.token_ids)


def test_humaneval_is_a_named_source(tokenizer):
    texts = read_texts("humaneval")
    assert len(texts) == 164 and all(source == "humaneval" for source, _ in texts)
    prompts = load_prompt_set("humaneval", tokenizer, limit=5)
    assert len(prompts) == 5 and prompts[0].token_ids


def test_bad_prompts_are_counted_listed_and_skipped(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "What is 2 + 2?"}, {"prompt": "   "}, {"prompt": "What is 2 + 2?"},
            {"prompt": "word " * 400}, {"prompt": "Name a colour."}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    prompt_set = build_prompt_set([str(path)], tokenizer, max_prompt_tokens=200)
    assert [p.text for p in prompt_set.prompts] == ["What is 2 + 2?", "Name a colour."]
    assert prompt_set.counts["prompts.jsonl"]["skipped"] == {"empty": 1, "duplicate": 1, "too_long": 1}
    assert sorted(s["reason"] for s in prompt_set.skipped) == ["duplicate", "empty", "too_long"]
    context = build_prompt_set([str(path)], tokenizer, max_new_tokens=60, context_length=80)
    assert {s["reason"] for s in context.skipped} >= {"exceeds_context"}


def test_local_csv_and_parquet(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p.csv").write_text("question,other\nWhy is the sky blue?,x\n")
    pq.write_table(pa.table({"question": ["Why is grass green?"]}), tmp_path / "p.parquet")
    prompts = build_prompt_set([str(tmp_path / "p.csv"), str(tmp_path / "p.parquet")], tokenizer,
                               text_field="question").prompts
    assert [p.text for p in prompts] == ["Why is the sky blue?", "Why is grass green?"]
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        build_prompt_set([str(tmp_path / "missing.jsonl")], tokenizer)
    with pytest.raises(ValueError, match="unknown prompt source"):
        build_prompt_set(["nonsense"], tokenizer)
