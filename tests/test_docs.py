"""The documentation: the generated configuration reference is current and complete, the README stays a
short front door, and every relative link in README.md and docs/*.md reaches an existing file and heading."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from common.config import Config
from common.config_reference import config_reference, sections


ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [a or b for a, b in LINK.findall(text)]


def test_configuration_page_is_current():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == config_reference(), (
        "docs/configuration.md differs from the config classes in common/config.py: run `make docs`")


def _keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config classes, walked here independently of the generator."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        nested = dataclasses.is_dataclass(hints[f.name])
        out += _keys(hints[f.name], f"{prefix}{f.name}.") if nested else [f"{prefix}{f.name}"]
    return out


def test_configuration_page_lists_every_key():
    page = config_reference()
    keys = _keys()
    missing = [key for key in keys if f"| `{key}` |" not in page]
    assert not missing, f"keys missing from the configuration reference: {missing}"
    assert {"eval.ks", "generate.vllm.python", "distill.loss", "onpolicy.weight", "engines.run", "wandb.mode", "target"} <= set(keys)
    headings = {f"## {prefix.rstrip('.')}" for prefix, _ in sections() if prefix}
    assert headings <= set(page.splitlines()) and len(headings) == 7


def test_config_docstrings_reach_the_page():
    page = config_reference()
    assert "| `eval.ks` | `[2, 4]` | Draft lengths to sweep. |" in page


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it under {README_MAX_LINES} and move detail to docs/")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I):  # http:, https:, mailto: ...
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no file {target.relative_to(ROOT) if ROOT in target.parents else target})")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no heading #{anchor} in {target.relative_to(ROOT)})")
    assert not broken, f"broken links in {page.relative_to(ROOT)}: {broken}"
