"""Fixed (prompt, response) text scored by the target: labels at prefill cost.

generate.mode=score with generate.response_field set: each prompt gets the target's chat template as in
generation, its response (+ EOS, so the draft learns where a reply ends) is the completion, and the
target runs teacher-forced over both in one batched forward, storing its top-k per response token in
the same shards as generated data. Sources of responses:
  a local .jsonl/.csv/.parquet file   the field/column generate.response_field, beside generate.text_field
  gsm8k                                its human-written solutions (generate.response_field: answer), with
                                       the calculator notes (<<48/2=24>>) removed and the closing
                                       "#### 72" written as "The answer is 72."
  pycode                               each function's whole source, fenced (generate.response_field:
                                       solution; common/pycode.py)
A prompt keeps the id and split it has as a plain prompt of that source, so a question held out from
generated data is held out here too (evaluation never sees a scored response of its own prompts).
"""

from __future__ import annotations

import re

from common.config import ConfigError
from common.prompts import Prompt, PromptSet, gsm8k_answers, local_prompt_file, read_texts
from common.pycode import python_functions


# Responses shipped with a named source: (source, response_field) -> reader of the responses in the
# order of the source's prompts.
NAMED_RESPONSES = {("gsm8k", "answer"): lambda: [clean_gsm8k(a) for a in gsm8k_answers()],
                   ("pycode", "solution"): lambda: [response for _, response in python_functions()]}
_CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")
_FINAL_ANSWER = re.compile(r"\n?#### *(.+)\s*$")


def clean_gsm8k(answer: str) -> str:
    """A GSM8K solution as a reply: 'She makes 9 * 2 = $<<9*2=18>>18.\\n#### 18' ->
    'She makes 9 * 2 = $18.\\nThe answer is 18.'"""
    text = _CALCULATOR_NOTE.sub("", answer)
    return _FINAL_ANSWER.sub(lambda m: f"\nThe answer is {m.group(1).strip()}.", text).strip()


def responses_by_prompt(sources: list[str], text_field: str, response_field: str) -> dict[tuple[str, str], str]:
    """{(source name, stripped prompt text): response} of every source (the first response of a prompt
    that appears twice). Raises ConfigError for a source that has no responses."""
    pairs: dict[tuple[str, str], str] = {}
    for source in sources:
        prompts = read_texts(source, text_field)
        if (source, response_field) in NAMED_RESPONSES:
            responses = NAMED_RESPONSES[(source, response_field)]()
        elif local_prompt_file(source) is not None:
            responses = [raw.text for raw in read_texts(source, response_field, "generate.response_field")]
        else:
            shipped = [f"{name} (generate.response_field={field})" for name, field in NAMED_RESPONSES]
            raise ConfigError(f"generate.sources: {source!r} has no responses to score; use a local file with a "
                              f"{response_field!r} field or one of: {', '.join(shipped)}")
        for prompt, response in zip(prompts, responses, strict=True):
            if not prompt.problem:
                pairs.setdefault((prompt.source, prompt.text.strip()), response.strip())
    return pairs


def response_rows(prompt_set: PromptSet, pairs: dict[tuple[str, str], str], tokenizer, eos_id: int,
                  context_length: int | None) -> list[tuple[Prompt, tuple[int, ...]]]:
    """(prompt, response ids + EOS) per kept prompt. A prompt whose response is empty, or which does not
    fit the context together with its response, is moved to prompt_set.skipped (reason
    'empty_response' or 'response_exceeds_context'), as a bad prompt is."""
    rows, kept = [], []
    for prompt in prompt_set.prompts:
        response = pairs.get((prompt.source, prompt.text), "")
        ids = tuple(tokenizer(response, add_special_tokens=False)["input_ids"]) + (eos_id,) if response else ()
        reason = ("empty_response" if not response else "response_exceeds_context"
                  if context_length is not None and len(prompt.token_ids) + len(ids) > context_length else None)
        if reason:
            count = prompt_set.counts[prompt.source]
            count["kept"] -= 1
            count["skipped"][reason] = count["skipped"].get(reason, 0) + 1
            prompt_set.skipped.append({"prompt_id": prompt.prompt_id, "source": prompt.source, "reason": reason,
                                       "text": prompt.text[:80], "num_tokens": len(prompt.token_ids) + len(ids)})
            continue
        kept.append(prompt)
        rows.append((prompt, ids))
    prompt_set.prompts = kept
    return rows
