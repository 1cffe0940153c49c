"""The README and the guides in docs/ link to files that exist: every relative Markdown link
`[text](path)` or `[text](path#anchor)` resolves from the file that holds it, and the README stays a
front door (short, with the way to a real cluster on its first screen)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# `](target)` with an optional "title"; the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _links(md: Path) -> list[str]:
    """The link targets of a Markdown file, code blocks and inline code left out."""
    text = FENCE.sub("", md.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def broken_links(md: Path) -> list[str]:
    """Relative links of ``md`` whose file does not exist (URLs and in-page anchors skipped)."""
    bad = []
    for target in _links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto:, ... and anchors within the page
        path = target.split("#", 1)[0]
        if not (md.parent / path).exists():
            bad.append(target)
    return bad


@pytest.mark.unit
@pytest.mark.parametrize("md", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_resolve(md: Path) -> None:
    assert not broken_links(md), f"{md.relative_to(ROOT)}: broken links {broken_links(md)}"


@pytest.mark.unit
def test_the_check_finds_a_broken_link(tmp_path: Path) -> None:
    """Not vacuous: a missing file is reported, an existing one, a URL, an anchor and a link inside
    a code block are not."""
    (tmp_path / "there.md").write_text("x")
    md = tmp_path / "a.md"
    md.write_text(
        "[ok](there.md) [ok](there.md#part) [web](https://example.org/x) [in](#top)\n"
        "[gone](missing.md) `[code](also-missing.md)`\n```\n[block](block-missing.md)\n```\n"
    )
    assert broken_links(md) == ["missing.md"]


@pytest.mark.unit
def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines, expected at most 200"
    assert any("sbatch" in line for line in lines[:40]), (
        "README.md: no sbatch in its first 40 lines"
    )


@pytest.mark.unit
def test_every_extended_test_file_has_its_ci_sibling_named_in_the_testing_guide():
    """The extended tier leaves CI: docs/testing.md names each file that has such a test, with what
    CI runs instead (a new `pytest.mark.extended` without its row fails here)."""
    guide = (ROOT / "docs" / "testing.md").read_text()
    marked = sorted(
        p.name
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^@pytest\.mark\.extended|marks=pytest\.mark\.extended", p.read_text(), re.M)
    )
    assert marked, "no extended test found: the tier's marker changed?"
    missing = [name for name in marked if f"`{name}" not in guide]
    assert not missing, f"docs/testing.md's extended table lacks {missing}"
