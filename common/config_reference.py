"""The configuration reference (docs/configuration.md), generated from the config dataclasses (common/config*.py).

    python -m common.config_reference > docs/configuration.md      (or: make docs)

Per section one table: the dotted key, its default and its meaning, the string literal written right
after the field in the class body. tests/test_docs.py checks that the page equals this output.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import typing

from common.config import Config


HEADER = """# Configuration reference

Generated from the config classes (`common/config.py` and the sections it imports) by `make docs`
(`python -m common.config_reference > docs/configuration.md`); do not edit by hand.
Every key can be set in a config file (`CONFIG=configs/x.yaml`) or on the command line
(`ARGS="key.sub=value ..."`); `python -m decode.bench --help` lists the same keys with their defaults.
"""


def field_docs(cls) -> tuple[str, dict[str, str]]:
    """(class docstring, field name -> docstring), read from the class's source with `ast`."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    docs, body = {}, node.body
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = after.value.value
    return ast.get_docstring(node) or "", docs


def sections(cls=Config, prefix: str = ""):
    """(dotted prefix, dataclass) for Config and every section under it, depth first."""
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from sections(hints[f.name], f"{prefix}{f.name}.")


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return json.dumps(value, ensure_ascii=False)


def _cell(text: str) -> str:
    """One table cell: whitespace collapsed, '|' escaped, and outside `code` '<' and '*' kept literal."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace("*", "\\*") for i, p in enumerate(parts))


def section_markdown(prefix: str, cls) -> str:
    """One section's heading, its class docstring and its table of keys."""
    class_doc, docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    lines = [f"## {prefix.rstrip('.') or 'top level'}", ""]
    if class_doc:
        lines += [_cell(class_doc), ""]
    lines += ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{prefix}{f.name}` | {_cell('`' + _default(f) + '`')} | {_cell(docs.get(f.name, ''))} |"
              for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]
    return "\n".join(lines) + "\n"


def config_reference() -> str:
    """The whole page: the header, then one section per config dataclass."""
    return "\n".join([HEADER] + [section_markdown(prefix, cls) for prefix, cls in sections()])


if __name__ == "__main__":
    print(config_reference(), end="")
