"""Every relative link in README.md and docs/*.md points at a file of this repository that exists, and every
`#anchor` at a heading of that file (GitHub's heading ids). Links into code blocks and code spans are not links."""

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are checked by the same rule below
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def markdown_pages() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def without_code_blocks(text: str) -> str:
    return re.sub(r"(?ms)^```.*?^```", "", text)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (where brackets are code, not links)."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def heading_ids(path: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, code marks and punctuation dropped, spaces -> '-'."""
    ids = set()
    for line in without_code_blocks(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            title = m.group(1).replace("`", "").strip().lower()
            ids.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return ids


def relative_links(path: Path) -> list[str]:
    text = prose(path.read_text())
    targets = LINK.findall(text) + IMAGE.findall(text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not ours


def test_the_pages_exist_and_link_somewhere():
    pages = markdown_pages()
    assert len(pages) >= 10, [p.name for p in pages]
    assert len(relative_links(REPO / "README.md")) >= 20  # the README is an entrance into docs/


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {os.path.relpath(dest, REPO)}")
        elif not str(dest).startswith(str(REPO)):
            broken.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest):
            broken.append(f"{target}: no heading with id '{anchor}' in {os.path.relpath(dest, REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n  " + "\n  ".join(broken)


def test_heading_ids_follow_githubs_rule():
    # Worked by hand from GitHub's rule: lower case, backticks and punctuation dropped, each space a hyphen.
    page = REPO / "docs" / "benchmarks.md"
    assert "throughput-on-real-data-shapes-and-mfu-make-bench-throughput-make-bench-throughput-bf16" in heading_ids(
        page
    )
    assert "ifbench-instruction-following-offline" in heading_ids(page)


# Pointers to a page or a section outside Markdown links: in code, error messages, recipes, tests and the pages'
# code spans. A section is pointed at as `README.md#<id>` or `docs/<page>.md#<id>` (GitHub's heading id), never by
# its title, so a renamed or moved heading fails here instead of leaving a dangling "see the README's X section".
POINTER = re.compile(r"(?<![\w/.-])(?:\.\./)?((?:docs/[\w.-]+|README)\.md)(?:#([\w-]+))?")
TITLE_POINTER = re.compile(r"""README(?:'s)?[:,]?\s+["“]|\.md['"]?[,:]?\s+["“][A-Z]""")


def pointer_sources() -> list[Path]:
    """Every file a pointer can sit in: the package (code and data), eval, demo, bench, scripts, recipes, tests,
    the Makefile, and the pages themselves."""
    files = [REPO / "Makefile", *markdown_pages()]
    for folder, patterns in (
        ("open_instruct", ("*.py", "*.yaml")),
        ("eval", ("*.py",)),
        ("demo", ("*.py",)),
        ("bench", ("*.py", "*.sh")),
        ("scripts", ("*",)),
        ("configs", ("*.yaml",)),
        ("tests", ("*.py",)),
    ):
        for pattern in patterns:
            files += [p for p in (REPO / folder).rglob(pattern) if p.is_file() and p.name != Path(__file__).name]
    return sorted(set(files))


def broken_pointers(path: Path) -> list[str]:
    broken = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for page, anchor in POINTER.findall(line):
            dest = REPO / page
            if not dest.exists():
                broken.append(f"line {n}: {page}: no such page")
            elif anchor and anchor not in heading_ids(dest):
                broken.append(f"line {n}: {page}#{anchor}: no heading with that id")
        prose_readme = path.suffix != ".md" and re.search(r"\bREADME\b(?!\.md)", line)
        if prose_readme or TITLE_POINTER.search(line):
            broken.append(
                f"line {n}: a section named by title, not README.md#<id> / docs/<page>.md#<id>: {line.strip()}"
            )
    return broken


def test_pointers_are_found_where_they_are_written():
    pointers = {str(p.relative_to(REPO)) for p in pointer_sources() if POINTER.search(p.read_text(errors="replace"))}
    # an error message (formats.DataError), a code comment, a recipe: the places issue 42 found broken pointers
    assert {"open_instruct/formats.py", "open_instruct/distributed.py", "configs/demo/rlvr_smollm2.yaml"} <= pointers
    assert POINTER.findall("see docs/data.md#data-formats and README.md, not x/docs/y.md") == [
        ("docs/data.md", "data-formats"),
        ("README.md", ""),
    ]
    assert TITLE_POINTER.search('(README: "The time model")') and TITLE_POINTER.search('docs/planner.md, "Memory"')


@pytest.mark.parametrize("path", pointer_sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_pointer_to_a_page_or_section_resolves(path: Path):
    broken = broken_pointers(path)
    assert not broken, f"{path.relative_to(REPO)}:\n  " + "\n  ".join(broken)
