"""The README, the changelog and every page under docs/ link only to files that exist, and to
headings that exist in them (GitHub's anchors): result folders get deleted as they are
superseded, and a link to one would otherwise rot silently. The README holds no changelog (that
is CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def test_slug_matches_githubs() -> None:
    assert slug("Will it fit? `python -m videotrain.plan --fit GB`") == \
        "will-it-fit-python--m-videotrainplan---fit-gb"
    assert slug("`memory=auto`") == "memoryauto"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


def test_readme_has_no_changelog_section() -> None:
    readme = (REPO / "README.md").read_text()
    assert not re.search(r"^#+\s*changelog", readme, re.I | re.M)  # it is CHANGELOG.md
