"""The documentation pages hold together: the README stays a short guide, every relative link lands on a
file (and, with ``#anchor``, on a heading of it), the README links every page, and every ``etrain``
command a page shows in a shell block is one the real CLI parser accepts.

The pages: README.md (the guide), docs/*.md (the manual), deploy/README.md (images, local clusters,
Kubernetes), benchmarks/README.md (the tables) and CONTRIBUTING.md. Anchors are GitHub's: the heading
in lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``, ``-1``, ``-2``... for repeats.
The Helm and kubectl commands are walked by tests/deploy/test_readme_commands.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [
    README,
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "deploy" / "README.md",
    REPO / "benchmarks" / "README.md",
    REPO / "CONTRIBUTING.md",
]
MAX_README_LINES = 300
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The page without fenced blocks and inline code (neither holds links or headings)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen.setdefault(f"{slug}-{count}", 1)
    return set(seen)


def links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(_prose(page.read_text(encoding="utf-8")))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)
    ]  # http:, https:, mailto: are not checked


def shell_lines(page: Path) -> list[str]:
    """Every command line of a page's bash/sh blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def test_the_readme_is_a_guide_of_at_most_300_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move the detail to docs/ and link it"


def test_the_anchor_rule_matches_github():
    page = REPO / "deploy" / "README.md"
    assert {"kubernetes-helmetrain", "try-it-locally-a-multi-node-cluster-without-kubernetes"} <= anchors(page)
    assert "make-gpu-check" in anchors(REPO / "docs" / "gpu.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_relative_link_lands_on_a_file_and_a_heading(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert broken == []


def test_the_readme_links_every_page():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    pages = set(PAGES[1:]) | {REPO / "docs" / "adding-a-model-family.md"}
    assert sorted(page.relative_to(REPO).as_posix() for page in pages if page.resolve() not in linked) == []


def _etrain_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for page in PAGES:
        for line in shell_lines(page):
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the command
                words = words[1:]
            if words and words[-1] == "&":
                words = words[:-1]
            if words and Path(words[0]).name == "etrain":
                commands.append((page.relative_to(REPO).as_posix(), words))
    return commands


def test_every_etrain_command_shown_parses_with_the_real_cli():
    from etrain.api.cli.parser import build_parser

    commands = _etrain_commands()
    assert len(commands) >= 14  # the quickstart's eleven, the deployment guide's two, the local cluster's one
    for page, words in commands:
        try:
            parsed = build_parser().parse_args(words[1:])
        except SystemExit as refused:
            raise AssertionError(f"{page}: `{shlex.join(words)}` is refused by the CLI") from refused
        spec = getattr(parsed, "file", None)
        if parsed.command in ("submit", "plan", "demo") and spec not in (None, "-"):
            assert (REPO / spec).is_file(), f"{page}: `{shlex.join(words)}` names a spec that does not exist"
