"""The documentation: docs/settings.md is what scripts/settings_docs.py writes from the settings
classes, every setting is on it under a flag and variable that its service accepts, every
relative link in README.md and docs/*.md leads to a file (and heading) that exists, and the pages
stay readable (no paragraph or list item over 150 words, a README of at most 150 lines, no
reference a reader cannot look up). No services, no models: a few seconds."""

import difflib
import functools
import importlib.util
import itertools
import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from pydantic_settings import CliSettingsSource, EnvSettingsSource

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _load_generator():
    spec = importlib.util.spec_from_file_location("settings_docs", ROOT / "scripts" / "settings_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


settings_docs = _load_generator()
RUN = f"run `{settings_docs.COMMAND}` and commit docs/settings.md"
SERVICES = [pytest.param(cls, heading, id=command) for heading, command, cls in settings_docs.SERVICES]


def test_settings_page_is_what_the_generator_writes():
    expected = settings_docs.render()
    actual = settings_docs.PAGE.read_text() if settings_docs.PAGE.exists() else ""
    if actual != expected:
        diff = difflib.unified_diff(
            actual.splitlines(), expected.splitlines(), "docs/settings.md", "generated", lineterm="", n=0
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"docs/settings.md is out of date with the settings classes: {RUN}.\n{shown}")


def _section(page: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", page, re.MULTILINE | re.DOTALL)
    return match.group(1) if match else ""


@pytest.mark.parametrize(("cls", "heading"), SERVICES)
def test_every_setting_is_on_the_settings_page(cls, heading):
    section = _section(settings_docs.PAGE.read_text(), heading)
    assert section, f"docs/settings.md has no section '## {heading}' for {cls.__name__}: {RUN}"
    missing = [
        f"{name} ({var})"
        for name in cls.model_fields
        for var in settings_docs.env_vars(cls, name)
        if f"`{var}`" not in section
    ]
    assert not missing, (
        f"{cls.__name__} settings missing from docs/settings.md ('## {heading}'): {', '.join(missing)}; {RUN}"
    )


@pytest.mark.parametrize(("cls", "heading"), SERVICES)
def test_documented_flags_and_variables_set_their_setting(cls, heading, monkeypatch):
    """What the page lists is what the service reads: each flag and each environment variable
    sets its field (the generator's rules for names match pydantic-settings')."""
    for var in [var for var in os.environ if var.startswith("SPECDEC_")]:
        monkeypatch.delenv(var)
    cli_flags = settings_docs.flags(cls)
    wrong = []
    for name, info in cls.model_fields.items():
        keys = {name, settings_docs._alias(info)}  # the sources report a field by its name or its alias
        for flag in cli_flags[name]:
            args = [flag] if info.annotation is bool else [flag, "1"]
            if not keys & set(CliSettingsSource(cls)(args=args)()):
                wrong.append(f"flag {flag} does not set {name}")
        for var in settings_docs.env_vars(cls, name):
            monkeypatch.setenv(var, "1")
            if not keys & set(EnvSettingsSource(cls)()):
                wrong.append(f"variable {var} does not set {name}")
            monkeypatch.delenv(var)
        if not cli_flags[name]:
            wrong.append(f"{name} has no flag")
    assert not wrong, f"{cls.__name__}: " + "; ".join(wrong)


# Links and anchors: markdown-it parses the pages (CommonMark plus GFM tables, as GitHub renders them).
MARKDOWN = MarkdownIt("commonmark").enable("table")


def github_slug(text: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation other than '-' and '_'
    dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    """Every heading anchor of a page; a repeated heading's anchor gets -1, -2, ... as on GitHub."""
    tokens, seen, result = MARKDOWN.parse(path.read_text()), {}, set()
    for opening, inline in itertools.pairwise(tokens):
        if opening.type != "heading_open":
            continue
        slug = github_slug("".join(child.content for child in inline.children if child.type in ("text", "code_inline")))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(f"{slug}-{count}" if count else slug)
    return result


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image of a page."""
    result = []
    for token in MARKDOWN.parse(path.read_text()):
        for child in token.children or []:
            target = (
                child.attrs.get("href")
                if child.type == "link_open"
                else child.attrs.get("src")
                if child.type == "image"
                else None
            )
            if target is not None:
                result.append((token.map[0] + 1, str(target)))
    return result


def broken_links(page: Path) -> list[str]:
    problems = []
    for line, target in links(page):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc:
            continue  # a web address
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        file = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not file.is_relative_to(ROOT) or not file.exists():
            problems.append(f"{where}: no such file in the repository")
        elif parts.fragment and file.suffix == ".md" and unquote(parts.fragment) not in anchors(file):
            problems.append(f"{where}: no heading with that anchor in {file.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_link_check_catches_a_missing_file_and_anchor(tmp_path, monkeypatch):
    """The check itself: a page with a good link, a missing file and a missing anchor."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other page\n\n## `specdec bench`: the protocol\n\n## Notes\n\n## Notes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n[ok](other.md#specdec-bench-the-protocol) [ok](other.md#notes-1) [ok](#top) [web](https://example.com/x)\n\n"
        "| a | b |\n|---|---|\n| [gone](missing.md) | [bad](other.md#nowhere) |\n"
    )
    assert broken_links(page) == [
        "page.md:7: missing.md: no such file in the repository",
        "page.md:7: other.md#nowhere: no heading with that anchor in other.md",
    ]


def test_readme_commands_exist():
    """The README's two commands (the main job, the tests; CI's .ci/run calls the second) are there
    and point at executable scripts."""
    readme = (ROOT / "README.md").read_text()
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"./{script}" in readme, f"README.md no longer shows ./{script}"
        assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_diagram_and_python_version_match_the_protos_and_pyproject():
    """The README's architecture diagram names every RPC of the three services and no other (its
    slash-separated lists and Generate), and its set-up line the Python that pyproject.toml requires."""
    import tomllib

    from specdec.v1 import coordinator_pb2, draft_pb2, verify_pb2

    readme = (ROOT / "README.md").read_text()
    diagram = readme.split("## Architecture", 1)[1].split("```")[1]
    named = {"Generate"} if "Generate (server stream)" in diagram else set()
    for names in re.findall(r"[A-Z]\w*(?: / [A-Z]\w*)+", diagram):
        named |= set(names.split(" / "))
    services = [
        (coordinator_pb2, "CoordinatorService"),
        (draft_pb2, "DraftService"),
        (verify_pb2, "VerifyService"),
    ]
    rpcs = {method.name for module, name in services for method in module.DESCRIPTOR.services_by_name[name].methods}
    assert named == rpcs, f"README.md's diagram names {sorted(named - rpcs)} and omits {sorted(rpcs - named)}"
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert f"Python {required.replace('>=', '>= ')}" in readme


MAX_WORDS = 150  # a paragraph, or a list item's own paragraphs (its nested items apart)
MAX_README_LINES = 150


def long_blocks(path: Path) -> list[str]:
    """``page:line: N words`` for every paragraph outside a list and every list item of more than
    MAX_WORDS words; table cells and code blocks are not counted."""
    tokens, found, items = MARKDOWN.parse(path.read_text()), [], []
    for previous, token in itertools.pairwise(tokens):
        if token.type == "list_item_open":
            items.append([token.map[0] + 1, 0])
        elif token.type == "list_item_close":
            line, words = items.pop()
            if words > MAX_WORDS:
                found.append(f"{path.name}:{line}: a list item of {words} words")
        elif token.type == "inline" and previous.type == "paragraph_open":
            words = len(token.content.split())
            if items:
                items[-1][1] += words
            elif words > MAX_WORDS:
                found.append(f"{path.name}:{token.map[0] + 1}: a paragraph of {words} words")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_paragraph_over_the_word_limit(page):
    found = long_blocks(page)
    assert not found, f"split or tighten (at most {MAX_WORDS} words each): " + "; ".join(found)


def test_long_blocks_counts_paragraphs_and_list_items(tmp_path):
    page = tmp_path / "page.md"
    long = " ".join(["word"] * (MAX_WORDS + 1))
    page.write_text(f"# Top\n\n{long}\n\n- short\n- {long}\n  - nested\n\n| {long} |\n|---|\n")
    assert long_blocks(page) == [
        f"page.md:3: a paragraph of {MAX_WORDS + 1} words",
        f"page.md:6: a list item of {MAX_WORDS + 1} words",
    ]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: at most {MAX_README_LINES}, the rest in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_names_the_work_process(page):
    """A numbered stop, issue or session of the project's work is nothing a reader can look up:
    say what it was about instead."""
    found = [
        f"{page.relative_to(ROOT)}:{number}: {match[0]!r}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in re.finditer(r"\b(stop|issue|session) [0-9]+", line, re.IGNORECASE)
    ]
    assert not found, "pages that name the work process: " + "; ".join(found)


CODE = sorted(
    path
    for folder in ("coordinator", "draft_service", "verify_service", "specdec", "specdec_app", "scripts", "tests")
    for path in (ROOT / folder).rglob("*.py")
    if "/v1/" not in str(path) and path.name != "test_docs.py"  # generated stubs; this file's examples
)
DOCS_REFERENCE = re.compile(r"\b(?:docs/)?((?:[a-z_-]+)\.md)#([\w-]+)")


def test_the_codes_references_to_the_docs_resolve():
    """Docstrings and comments point readers at ``docs/<page>.md#<anchor>``: each page and heading
    exists, so that moving a section cannot leave the code pointing nowhere."""
    pages = {page.name: page for page in PAGES}
    problems = [
        f"{path.relative_to(ROOT)}:{number}: {match[0]}"
        for path in CODE
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in DOCS_REFERENCE.finditer(line)
        if match[1] not in pages or match[2] not in anchors(pages[match[1]])
    ]
    assert not problems, "references to no page or heading:\n" + "\n".join(problems)


def test_no_code_names_the_work_process():
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in CODE
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\b(stop|issue) [0-9]+\b", line, re.IGNORECASE)
    ]
    assert not found, "code that names the work process: " + ", ".join(found)
