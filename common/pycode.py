"""`pycode`: Python functions as (prompt, response) pairs, from the source of a wheel the project pins.

The prompt is what HumanEval-style requests look like -- a function's signature and docstring, body
removed -- and the response is the whole function, as a fenced Python block. The functions come from the
inspect-evals wheel (pinned in scripts/setup.sh, installed for its prompt data): human-written, documented
code of many authors. Its HumanEval and MBPP harness modules are left out, and so is any file that names
HumanEval, so nothing of the project's code evaluation set can reach training.

    pairs = python_functions()  # [(prompt, response)] in file order, deterministic for one wheel version
"""

from __future__ import annotations

import ast
import functools
import textwrap

from common.prompts import wheel_files


CODE_WHEEL = "inspect-evals"
# Modules of the wheel that evaluate code generation: nothing of theirs is trained on.
EXCLUDED_PARTS = ("humaneval", "human_eval", "mbpp", "bigcodebench", "ds1000", "class_eval", "apps")
EXCLUDED_MARKERS = ("HumanEval", "human_eval", "humaneval")
# A function of 200-2,500 characters (~50-650 tokens): long enough to hold logic, short enough that the
# prompt and the whole function fit the context; docstrings of fewer than 20 characters say too little.
MIN_CHARS, MAX_CHARS, MIN_DOC_CHARS = 200, 2500, 20


@functools.cache
def python_functions() -> list[tuple[str, str]]:
    """(signature + docstring, fenced function) of every public documented function of CODE_WHEEL."""
    pairs = []
    for path in sorted(p for p in wheel_files(CODE_WHEEL, ".py") if not set(p.parts) & set(EXCLUDED_PARTS)):
        source = path.read_text(encoding="utf-8", errors="replace")
        if any(marker in source for marker in EXCLUDED_MARKERS):
            continue
        pairs += functions_of(source)
    return pairs


def functions_of(source: str) -> list[tuple[str, str]]:
    """The (prompt, response) pairs of one module's documented public functions and methods."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < MIN_DOC_CHARS:
            continue
        # node.lineno is the `def` line (decorators sit above it); body[0] is the docstring.
        whole = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if not MIN_CHARS <= len(whole) <= MAX_CHARS or len(node.body) < 2:
            continue
        header = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno]))
        pairs.append((header + "\n", f"```python\n{whole}\n```"))
    return pairs
