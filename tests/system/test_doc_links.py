"""Every relative link in README.md and docs/ points at a file of this repository, and every
`#anchor` at a heading of its page, so moving a section shows up here rather than in a reader's
404. Fast and offline: only the Markdown files are read."""

from __future__ import annotations

import re
from pathlib import Path

from tests.paths import REPO

_LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+(?:\([^()\s]*\))?[^()\s]*)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced blocks, where a Markdown link is a link."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_prose(page.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return _LINK.findall(_CODE.sub("", _prose(page.read_text())))


def test_the_slug_is_githubs() -> None:
    assert (
        _slug("`n` > 1: served whole by the decode worker")
        == "n--1-served-whole-by-the-decode-worker"
    )
    assert _slug("9. Layers") == "9-layers"
    assert _slug("Live flood (router process)") == "live-flood-router-process"


def test_every_relative_link_resolves() -> None:
    broken: list[str] = []
    checked = 0
    for page in _pages():
        for target in _links(page):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = page if not path else (page.parent / path).resolve()
            checked += 1
            where = f"{page.relative_to(REPO)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no heading with that anchor)")
    assert checked > 50, checked
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_stays_a_front_page() -> None:
    """What it is, the two commands, a minimal config, links (issue 32): the operator's manual
    lives in docs/, so the README stays short."""
    size = len((REPO / "README.md").read_bytes())
    assert size < 15_000, f"README.md is {size} bytes: move the detail to docs/"
