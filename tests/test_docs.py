"""The links of README.md and docs/ (the journal too): every relative link names a file or
directory of the repository, and every #anchor a heading of its page (as GitHub makes anchors of
headings). The reference pages (README.md, docs/*.md) carry no dated entries: those belong in
docs/journal/ and benchmarks/results/."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES = [*REFERENCE, *sorted((ROOT / "docs" / "journal").glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
CODE_BLOCK = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bUTC\b")


def prose(page: Path) -> str:
    """The page without its code blocks, whose text is no markdown."""
    return CODE_BLOCK.sub("", page.read_text(encoding="utf-8"))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: the text shown, lower case, without
    punctuation but - and _, spaces as -; a repeated one gets -1, -2..."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in HEADING.findall(prose(page)):
        shown = LINK.sub(r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", shown.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return found


def test_the_pages_are_found() -> None:
    assert len(PAGES) > 3 and all(page.is_file() for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    text = re.sub(r"`[^`\n]*`", "", prose(page))  # links in code spans are no links
    broken = []
    for target in (match[2] for match in LINK.finditer(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", REFERENCE, ids=lambda page: str(page.relative_to(ROOT)))
def test_reference_pages_carry_no_dated_entries(page: Path) -> None:
    dated = [line for line in page.read_text(encoding="utf-8").splitlines() if DATED.search(line)]
    assert not dated, f"{page.name}: dated lines belong in docs/journal/: {dated[:3]}"
