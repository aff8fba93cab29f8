"""Every relative link in README.md and docs/*.md points at a file of this repository that exists, and every
`#anchor` at a heading of that file (GitHub's heading ids). Links into code blocks and code spans are not links."""

import ast
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
        dest = Path(os.path.normpath(page.parent / file_part)) if file_part else page
        if file_part.startswith("/") or not dest.is_relative_to(REPO):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no file {os.path.relpath(dest, REPO)}")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest):
            broken.append(f"{target}: no heading with id '{anchor}' in {os.path.relpath(dest, REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n  " + "\n  ".join(broken)


# A path a page writes with ../ (a link, a code span, a code block) names a file of this repository, read from the
# page's folder: a file beside the repository is not there for a reader of the repository.
PARENT_PATH = re.compile(r"(?<![\w.~/-])((?:\.\./)+[\w./-]*\w)")


def paths_outside(page: Path) -> list[str]:
    bad = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for path in PARENT_PATH.findall(line):
            dest = Path(os.path.normpath(page.parent / path))
            if not dest.is_relative_to(REPO):
                bad.append(f"line {n}: {path}: outside the repository")
            elif not dest.exists():
                bad.append(f"line {n}: {path}: no file {os.path.relpath(dest, REPO)} in the repository")
    return bad


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_stays_inside_the_repository(page: Path):
    bad = paths_outside(page)
    assert not bad, f"{page.relative_to(REPO)} points outside the repository:\n  " + "\n  ".join(bad)


def test_paths_outside_are_found(tmp_path: Path):
    # Worked by hand: from docs/, ../README.md is the repository's README; ../../../x (above the checkout, whatever it
    # is called) and ../shared/y (no such folder here) are not in the repository; ".../wide" (an elided path in an
    # error message) is no path.
    page = REPO / "docs" / "_probe.md"
    text = "see [the README](../README.md), `../shared/reference/tulu3.md`, ../../../x.md and '.../wide'"
    found = PARENT_PATH.findall(text)
    assert found == ["../README.md", "../shared/reference/tulu3.md", "../../../x.md"]
    verdicts = [Path(os.path.normpath(page.parent / f)) for f in found]
    assert [v.is_relative_to(REPO) and v.exists() for v in verdicts] == [True, False, False]
    assert not verdicts[2].is_relative_to(REPO)


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


# What the pages name in the code: every module of the package (and every launch script) is in the architecture
# page, and every `module.function` (or `module.Class.method`) a page names exists. Resolved by parsing the modules'
# source (ast), never by importing them, so this stays fast and needs no torch.
ARCHITECTURE = REPO / "docs" / "architecture.md"
CODE_FOLDERS = ("open_instruct", "demo", "eval", "bench", "tests")  # python -m <folder>.<module> and dotted names
# `config.json`, `plan.py`: a file's name, not module.attribute
FILE_SUFFIXES = set("py md json jsonl yaml yml txt sh npy safetensors gz png toml gguf log csv html".split())
# Other libraries' option names a page quotes that start like one of our modules: verl's `data:` group
# (`data.train_files`) in the porting tables.
NOT_OUR_CODE = {"docs/porting.md": ("data.",)}
DOTTED_SPAN = re.compile(r"`((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)(?:\(\))?`")
MODULE_SPAN_OWNER = re.compile(r"`(\w+)\.py`(?:'s|:)\s+((?:`\w+`(?:,\s+|\s+and\s+)?)+)")
IMPORT_LINE = re.compile(r"^\s*from\s+((?:open_instruct|demo|eval|bench)\.[\w.]+)\s+import\s+\(?([\w ,]+)\)?", re.M)
RUN_MODULE = re.compile(r"python3?\s+-m\s+((?:open_instruct|demo|eval|bench)(?:\.\w+)*)")


def package_modules() -> list[Path]:
    return sorted(p for p in (REPO / "open_instruct").glob("*.py") if p.name != "__init__.py")


def launch_scripts() -> list[Path]:
    return sorted(p for p in (REPO / "scripts").iterdir() if p.is_file())


def module_file(dotted: str) -> Path | None:
    """The source file of `open_instruct.x`, `demo.x`, `tests.test_x`, or a bare package module name `x`
    (`rlvr_ppo`) or test module (`test_fsdp`); a folder package's `__init__.py`; None when there is none."""
    parts = dotted.split(".")
    if parts[0] in CODE_FOLDERS:
        path = REPO.joinpath(*parts)
    elif len(parts) == 1 and parts[0].startswith("test_"):
        path = REPO / "tests" / parts[0]
    elif len(parts) == 1:
        path = REPO / "open_instruct" / parts[0]
    else:
        return None
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


_DEFINITIONS: dict[Path, dict[str, ast.AST]] = {}


def top_level_names(path: Path) -> dict[str, ast.AST]:
    """Every name a module defines at its top level (def, class, assignment, import; inside if/try too)."""
    if path not in _DEFINITIONS:
        names: dict[str, ast.AST] = {}
        statements = list(ast.parse(path.read_text()).body)
        while statements:
            node = statements.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            names[name.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names[(alias.asname or alias.name).split(".")[0]] = node
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                statements += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                for handler in getattr(node, "handlers", []):
                    statements += handler.body
        _DEFINITIONS[path] = names
    return _DEFINITIONS[path]


def class_attributes(node: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes and fields, and the attributes its methods assign to `self`."""
    names = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item is not node:
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
            names.add(item.attr)
    return names


def where_defined(name: str) -> list[str]:
    """The package modules that define `name` at their top level (for the failure message)."""
    return [f"open_instruct/{p.name}" for p in package_modules() if name in top_level_names(p)]


def classes_named(name: str) -> list[tuple[Path, ast.ClassDef]]:
    """The package's top-level classes called `name`."""
    found = []
    for path in package_modules():
        node = top_level_names(path).get(name)
        if isinstance(node, ast.ClassDef):
            found.append((path, node))
    return found


def missing_code(dotted: str) -> str | None:
    """Why `dotted` (module.name[.attribute...], or Class.attribute for a class of the package) names nothing in
    the code; None when it resolves, or when its head is none of ours (`torch.load`, `cfg.seed`, `GRPOConfig.x`)."""
    parts = dotted.split(".")
    classes = classes_named(parts[0]) if not module_file(parts[0]) else []
    if classes:
        if any(parts[1] in class_attributes(node) for _, node in classes):
            return None
        where = ", ".join(os.path.relpath(path, REPO) for path, _ in classes)
        return f"class `{parts[0]}` ({where}) has no `{parts[1]}`"
    for split in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module: open_instruct.judge.Judge
        path = module_file(".".join(parts[:split]))
        if path:
            break
    else:
        return None
    where = os.path.relpath(path, REPO)
    name, *rest = parts[split:]
    node = top_level_names(path).get(name)
    if node is None:
        if module_file(".".join(parts[: split + 1])):  # a submodule: eval.verifiable
            return None
        elsewhere = where_defined(name)
        return f"{where} has no `{name}`" + (f" (defined in {', '.join(elsewhere)})" if elsewhere else "")
    if rest and isinstance(node, ast.ClassDef) and rest[0] not in class_attributes(node):
        return f"{where}: class `{name}` has no `{rest[0]}`"
    return None


def named_code(page: Path) -> list[tuple[int, str]]:
    """(line, dotted name) for every module.name a page names: in code spans (`rlvr_ppo.collect_rollout`), as a
    module file's names (`distillation.py`: `teacher_scores`, ...), in code blocks' imports and `python -m` lines."""
    rel = str(page.relative_to(REPO))
    found = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for dotted in DOTTED_SPAN.findall(line):
            suffix = dotted.rsplit(".", 1)[1]
            if suffix not in FILE_SUFFIXES and not dotted.startswith(NOT_OUR_CODE.get(rel, ())):
                found.append((n, dotted))
        for module, names in MODULE_SPAN_OWNER.findall(line):
            if module_file(module):
                found += [(n, f"{module}.{name}") for name in re.findall(r"`(\w+)`", names)]
        for module in RUN_MODULE.findall(line):
            found.append((n, module + ".__module__"))
    for match in IMPORT_LINE.finditer(page.read_text()):
        n = page.read_text().count("\n", 0, match.start()) + 1
        found += [(n, f"{match.group(1)}.{name.strip()}") for name in match.group(2).split(",") if name.strip()]
    return found


@pytest.mark.parametrize("module", package_modules() + launch_scripts(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_and_script_is_in_the_architecture_page(module: Path):
    named = re.search(rf"(?<![\w.-]){re.escape(module.name)}(?!\w)", ARCHITECTURE.read_text()) is not None
    assert named, (
        f"docs/architecture.md does not name {module.relative_to(REPO)}: add it to the layout (bottom to top, "
        f"with what it holds)"
    )


def test_the_architecture_page_names_only_modules_that_exist():
    block = ARCHITECTURE.read_text().split("open_instruct/", 1)[1].split("\ndemo/", 1)[0]
    named = set(re.findall(r"(?<![\w/.-])(\w+)\.py\b(?!:)", block))  # `file.py:name` is a spec
    gone = sorted(name for name in named if not (REPO / "open_instruct" / f"{name}.py").is_file())
    assert not gone, f"docs/architecture.md's layout names modules open_instruct/ does not have: {gone}"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_function_exists(page: Path):
    missing = []
    for n, dotted in named_code(page):
        if dotted.endswith(".__module__"):
            module = dotted.removesuffix(".__module__")
            if not module_file(module):
                missing.append(f"line {n}: `python -m {module}`: no module {module.replace('.', '/')}.py")
            continue
        why = missing_code(dotted)
        if why:
            missing.append(f"line {n}: `{dotted}`: {why}")
    assert not missing, f"{page.relative_to(REPO)} names code that does not exist:\n  " + "\n  ".join(missing)


def test_named_code_is_found_and_resolved():
    # Worked by hand: what a line names, and each verdict.
    assert missing_code("rl_algorithms.group_advantages") is None
    assert missing_code("open_instruct.judge.Judge") is None
    assert missing_code("eval.verifiable") is None  # a module, not a function
    assert missing_code("torch.load") is None  # not ours: not checked
    assert missing_code("rlvr_ppo.group_advantages") == (
        "open_instruct/rlvr_ppo.py has no `group_advantages` (defined in open_instruct/rl_algorithms.py)"
    )
    assert missing_code("runtime.RunContext.no_such_method") == (
        "open_instruct/runtime.py: class `RunContext` has no `no_such_method`"
    )
    assert missing_code("RunContext.no_such_method") == (
        "class `RunContext` (open_instruct/runtime.py) has no `no_such_method`"
    )
    assert missing_code("GRPOConfig.__post_init__") is None  # TRL's class, not ours
    block = "```python\nfrom open_instruct.rl_algorithms import AdvantageInputs, group_baseline\n```\n"
    assert IMPORT_LINE.findall(block) == [("open_instruct.rl_algorithms", "AdvantageInputs, group_baseline")]
    assert RUN_MODULE.findall("python -m open_instruct.plan configs/x.yaml") == ["open_instruct.plan"]
    assert MODULE_SPAN_OWNER.findall("(`distillation.py`: `teacher_scores`, `metrics`)") == [
        ("distillation", "`teacher_scores`, `metrics`")
    ]
    assert "config.yaml" not in str(named_code(REPO / "docs" / "running.md"))
    assert "distillation.teacher_scores" in {dotted for _, dotted in named_code(ARCHITECTURE)}
