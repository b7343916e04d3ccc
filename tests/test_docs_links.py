# test_docs_links.py: every relative link in README.md and docs/*.md points at a file of the repository,
# and every #anchor at a heading of its target page (GitHub's heading slugs); README's test command is
# the one .ci/run executes. No network.
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def links(page: pathlib.Path):
    fenced = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            for m in LINK.finditer(line):
                yield n, m.group(1)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for n, target in links(page):
        if re.match(r"^[a-z]+:", target):          # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}:{n}: {target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{page.name}:{n}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_readme_test_command_matches_ci():
    """README's "Install and run the tests" command is the one .ci/run executes on a clean clone."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && python -m pytest tests -q -n 2 --dist worksteal' in readme
    assert 'pip install -q -e ".[test]"' in ci and "python -m pytest tests -q -n 2 --dist worksteal" in ci
    assert 'python -c "import torch" 2>/dev/null || pip install torch' in readme   # keeps an installed torch
