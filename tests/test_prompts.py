"""Prompt sources, chat template, de-duplication, bad-prompt reporting and the train/eval split."""

import json

import pytest

from common.config import load_config
from common.errors import UserError
from common.models import load_tokenizer
from common.prompts import (EMBEDDED_PARTS, PromptSourceError, build_prompt_set, evaluation_split, load_prompt_set,
                            read_texts, split_of)
from common.pycode import functions_of, python_functions
from distill.generation.pairs import responses_by_prompt


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
    assert len(texts) == 164 and all(raw.source == "humaneval" and raw.problem is None for raw in texts)
    prompts = load_prompt_set("humaneval", tokenizer, limit=5)
    assert len(prompts) == 5 and prompts[0].token_ids


def test_gpqa_is_a_named_source(tokenizer):
    texts = read_texts("gpqa")
    assert len(texts) == 198 and all(raw.source == "gpqa" and raw.problem is None for raw in texts)
    assert "A)" in texts[0].text and "Answer: $LETTER" in texts[0].text  # the question as its payload asks it
    assert "gpqa" not in EMBEDDED_PARTS  # an out-of-domain set: never in the embedded training mix
    prompts = load_prompt_set("gpqa", tokenizer, limit=3)
    assert len(prompts) == 3 and prompts[0].token_ids


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
    with pytest.raises(PromptSourceError, match="missing.jsonl"):
        build_prompt_set([str(tmp_path / "missing.jsonl")], tokenizer)
    with pytest.raises(PromptSourceError, match="unknown prompt source"):
        build_prompt_set(["nonsense"], tokenizer)
    assert issubclass(PromptSourceError, UserError)


def test_unreadable_jsonl_lines_are_skipped_with_file_and_line(tokenizer, tmp_path):
    """One bad line (not UTF-8, not JSON, not an object) no longer loses the whole file."""
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"prompt": "What is 2 + 2?"}\n'
                     b'{"prompt": "caf\xe9"}\n'            # Latin-1, not UTF-8
                     b'{"prompt": "unterminated\n'
                     b'["a", "list"]\n'
                     b'\n'
                     b'{"prompt": "Name a colour."}\n')
    with pytest.warns(UserWarning, match="skipped 3 unreadable row"):
        prompt_set = build_prompt_set([str(path)], tokenizer)
    assert [p.text for p in prompt_set.prompts] == ["What is 2 + 2?", "Name a colour."]
    assert prompt_set.counts["mixed.jsonl"]["skipped"] == {"unreadable": 3}
    problems = [s["text"] for s in prompt_set.skipped]
    assert problems[0].startswith(f"{path}:2: not UTF-8 (byte 0xe9")
    assert problems[1].startswith(f"{path}:3: not valid JSON")
    assert problems[2] == f"{path}:4: a JSON list, not an object with named fields"


@pytest.mark.parametrize("name, content, message", [
    ("bad.csv", b"prompt\ncaf\xe9\n", "bad.csv' cannot be read"),
    ("bad.parquet", b"not parquet at all", "bad.parquet' cannot be read"),
    ("other.csv", b"question\nWhy?\n", "other.csv' has no column 'prompt' \\(columns: \\['question'\\]\\)"),
    ("other.jsonl", b'{"question": "Why?"}\n', "other.jsonl': no row has the field 'prompt'"),
])
def test_unreadable_prompt_files_are_named(tokenizer, tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(PromptSourceError, match=message):
        build_prompt_set([str(tmp_path / name)], tokenizer)


def test_a_local_file_given_for_evaluation_is_used_whole(tokenizer, tmp_path):
    """The hash split holds out prompts of sources that can feed training; a file named only for
    evaluation is all evaluation prompts (the old code kept ~10% of it and often found none)."""
    from decode.eval_speedup import eval_prompts

    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Question number {i}?"}) for i in range(6)))
    assert evaluation_split(str(path), ["embedded"]) is None
    assert evaluation_split(str(path), ["embedded", str(path)]) == "eval"  # also trained on: held-out part only
    assert evaluation_split("humaneval", ["embedded"]) == "eval"
    cfg = load_config("configs/tiny.yaml", [f"eval.prompts=[{path}]", "eval.num_prompts=6"])
    sets = eval_prompts(cfg, tokenizer, context_length=1024)
    assert sorted(p.text for p in sets[str(path)]) == [f"Question number {i}?" for i in range(6)]


def test_pycode_pairs_a_signature_and_docstring_with_the_whole_function():
    source = '''
def add(a: int, b: int) -> int:
    """Add two integers and return their sum, checking nothing."""
    total = a + b
    # a comment long enough that the function passes the minimum size of a training pair .........
    return total


def _private(x):
    """A private helper: never a request a user would make of the model."""
    return x * 2 + 1 - 1 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0 + 0


class Box:
    def size(self) -> int:
        """How many items the box holds, counted one by one from its list."""
        count = 0
        for _ in self.items:  # a loop long enough to pass the minimum size of a training pair .....
            count += 1
        return count

    def undocumented(self):
        return [item for item in self.items if item is not None and item != "" and item != 0 and item]
'''
    pairs = functions_of(source)
    assert [prompt.splitlines()[0] for prompt, _ in pairs] == ["def add(a: int, b: int) -> int:",
                                                               "def size(self) -> int:"]
    prompt, response = pairs[1]
    assert prompt.endswith('counted one by one from its list."""\n') and "count = 0" not in prompt
    assert response.startswith("```python\ndef size(self) -> int:\n") and response.endswith("return count\n```")


def test_pycode_is_a_named_source_that_holds_nothing_of_humaneval():
    pairs = python_functions()
    assert len(pairs) > 1000 and "pycode" not in EMBEDDED_PARTS
    assert not any("HumanEval" in prompt + response or "human_eval" in prompt + response for prompt, response in pairs)
    assert [raw.text for raw in read_texts("pycode")] == [prompt for prompt, _ in pairs]
    humaneval = {raw.text.strip() for raw in read_texts("humaneval")}
    assert not humaneval & {prompt.strip() for prompt, _ in pairs}
    responses = responses_by_prompt(["pycode"], "prompt", "solution")  # what generate.mode=score reads
    prompt, response = pairs[0]
    assert responses[("pycode", prompt.strip())] == response.strip() and len(responses) > 1000
