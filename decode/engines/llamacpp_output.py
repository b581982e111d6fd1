"""What llama.cpp's tools print, parsed: the generated text, how long decoding took, and the
speculative counters.

llama-completion (plain decoding) prints the text on stdout and its timers on stderr:
    common_perf_print:    sampling time =      71.60 ms
    common_perf_print:        eval time =     245.12 ms /    31 runs   (    7.91 ms per token, ...)
`eval time` covers the forwards after the prompt's; the first new token comes from the prompt's
logits, so new tokens = runs + 1. Decoding time = eval + sampling, the span the speculative tools'
own timer covers (it starts after the prompt and includes sampling).

llama-speculative and llama-speculative-simple print the prompt and the text on stdout, and on stderr
    decoded   33 tokens in    0.412 seconds, speed:   80.131 t/s
    n_predict = 33
    n_drafted = 36
    n_accept  = 22
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.errors import UserError


NUMBER = r"([0-9]+(?:\.[0-9]+)?)"


class LlamaCppOutputError(UserError):
    """A llama.cpp tool's output lacks what we read from it (a different llama.cpp version?)."""


@dataclass
class LlamaCppResult:
    text: str
    new_tokens: int
    seconds: float
    accepted: int | None = None
    drafted: int | None = None
    prompt_ids: list[int] | None = None
    """The prompt as llama.cpp tokenized it (from --verbose-prompt), to check it is our prompt."""


def _number(pattern: str, text: str, what: str) -> float:
    match = re.search(pattern, text)
    if match is None:
        raise LlamaCppOutputError(f"llama.cpp printed no {what} (looked for /{pattern}/)")
    return float(match.group(1))


def parse_plain(stdout: str, stderr: str, eos_text: str) -> LlamaCppResult:
    """llama-completion run with --no-display-prompt --verbose-prompt."""
    # ":  eval time", not ": prompt eval time"
    runs = int(_number(r":\s+eval time =\s*[0-9.]+ ms /\s*([0-9]+) runs", stderr, "eval runs"))
    eval_ms = _number(rf":\s+eval time =\s*{NUMBER} ms", stderr, "eval time")
    sampling_ms = _number(rf"sampling time =\s*{NUMBER} ms", stderr, "sampling time")
    # The text, " [end of text]\n" after an end-of-generation token, then "\n\n" before the timers.
    text = stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")
    return LlamaCppResult(text=_without_eos(text, eos_text), new_tokens=runs + 1,
                          seconds=(eval_ms + sampling_ms) / 1e3, prompt_ids=verbose_prompt_ids(stderr))


def parse_speculative(stdout: str, stderr: str, prompt_text: str, eos_text: str) -> LlamaCppResult:
    """llama-speculative or llama-speculative-simple: stdout is "\n\n", the prompt, the generated text,
    then "\n\n" twice (before and after the timers)."""
    body = stdout.removeprefix("\n\n")
    if not body.startswith(prompt_text):
        raise LlamaCppOutputError("llama.cpp's speculative output does not start with the prompt it was given")
    return LlamaCppResult(
        text=_without_eos(body[len(prompt_text):].removesuffix("\n\n\n\n"), eos_text),
        new_tokens=int(_number(r"n_predict\s*=\s*([0-9]+)", stderr, "n_predict")),
        seconds=_number(rf"decoded\s+[0-9]+ tokens in\s+{NUMBER} seconds", stderr, "decoding time"),
        accepted=int(_number(r"n_accept\s*=\s*([0-9]+)", stderr, "n_accept")),
        drafted=int(_number(r"n_drafted\s*=\s*([0-9]+)", stderr, "n_drafted")))


def verbose_prompt_ids(stderr: str) -> list[int]:
    """The token ids --verbose-prompt lists ('number of tokens in prompt = N', then N lines 'id -> piece',
    each after a '0.11.651.770 I ' time-and-level prefix when stderr is not a terminal)."""
    count = int(_number(r"number of tokens in prompt = ([0-9]+)", stderr, "prompt token count"))
    after = stderr[stderr.index("number of tokens in prompt"):]
    ids = [int(i) for i in re.findall(r"^(?:[0-9.]+ [A-Z] )?\s*([0-9]+) -> '", after, flags=re.MULTILINE)[:count]]
    if len(ids) != count:
        raise LlamaCppOutputError(f"llama.cpp listed {len(ids)} of its {count} prompt tokens")
    return ids


def _without_eos(text: str, eos_text: str) -> str:
    """The end-of-generation token's text, which some tools print and others do not, removed."""
    return text[: -len(eos_text)] if eos_text and text.endswith(eos_text) else text
