"""The docs point at what exists: every relative Markdown link in README.md and the docs resolves
to a file (and its #anchor to a heading there), and every repository path the prose names
(docs/sim.md, wire/records.py, ...) is there."""

from __future__ import annotations

import re

import pytest

from tests.paths import REPO

PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", REPO / "sample_traces" / "README.md",
                *REPO.glob("docs/**/*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
TOP = "docs|bench|scripts|tests|engine|profiler|server|console|cli|themes|sample_traces"
PLACEHOLDER = re.compile(r"/(?!README\.)[A-Z_]+\.")  # engine/sim/profiles/NAME.json: yours to fill in
PATH = re.compile(rf"(?<![\w/.-])((?:{TOP})/[\w./-]*\w\.(?:md|py|json|sh|cpp|tcss|trace))(?![\w*])")


def anchors(page) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def broken_links(page) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or a place on this page
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve()
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page.relative_to(REPO)}: links to nothing: {broken_links(page)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_repository_path_named_exists(page):
    named = {p for p in PATH.findall(page.read_text()) if not PLACEHOLDER.search(p)}
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"{page.relative_to(REPO)}: names files that are not in the repository: {missing}"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, here\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading-here) [web](https://example.com) [gone](gone.md) "
                    "[no anchor](there.md#elsewhere)")
    assert broken_links(page) == ["gone.md", "there.md#elsewhere"]
