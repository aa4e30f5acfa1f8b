"""The README and docs/ read as a manual: the README's reading path (the main command, then the test command, and
CI runs what the README says), every link resolves, every module, object and file they name exists, no diary words
or commit hashes, and the recipes' critic warm-up is the one documented."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MANUAL = [README, *DOCS]
MAIN_COMMAND = "bash scripts/setup.sh && bash examples/cpu/run_tiny_group_ppo.sh"
TEST_COMMAND = ".venv/bin/python -m pytest"

#: words of a lab notebook, not a manual (whole words, any case)
DIARY = re.compile(r"\b(sessions?|earlier|scratch)\b", re.IGNORECASE)
#: a commit hash: 7-40 hex digits with at least one letter and one digit
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
MODULE = re.compile(r"python -m (verl_group_ppo(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
#: a dotted name of the package or of something in it (a trailing sentence dot is not part of it)
DOTTED = re.compile(r"(?<![\w.])verl_group_ppo(?:\.[A-Za-z_]\w*)+")
#: a file inside the repository's source folders (with its extension), or one of their folders (with a trailing slash)
FILE_PATH = re.compile(r"(?<![\w./-])(?:verl_group_ppo|tests|benchmarks|examples|scripts|requirements)/"
                       r"(?:[\w./-]*\.(?:py|sh|md|yaml|yml|txt|toml|json|jsonl|csv|png)\b|(?:[\w.-]+/)*)(?![\w<{*])")
#: an inline link or image, [text](target) / ![alt](target), with an optional "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
#: a reference-style link definition, [label]: target
LINK_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
FENCE = re.compile(r"^\s*(```|~~~)")


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of ``path`` outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(_lines(path), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def _code_blocks(path: Path, language: str) -> list[tuple[int, list[str]]]:
    """(line number of the opening fence, lines) of each fenced block of ``language``, in order."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(_lines(path), 1):
        if current is None and line.strip() == f"```{language}":
            current, start = [], number
        elif current is not None and line.strip() == "```":
            blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _command(line: str) -> str:
    """A shell line without its trailing comment and surrounding blanks."""
    return line.split(" #", 1)[0].strip()


# ----------------------------------------------------------------------------------------------------------------------
# the README's reading path


def _headings(path: Path) -> list[tuple[int, int, str]]:
    """(line number, level, text) of every Markdown heading of ``path`` outside code blocks."""
    found = []
    for number, line in _prose(path):
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if match:
            found.append((number, len(match.group(1)), match.group(2)))
    return found


def test_readme_opens_with_the_main_command_then_the_test_command():
    """The first two shell blocks a reader meets are the README's two commands, in order: setup and the main job
    (in the first section after the introduction), then the test command."""
    blocks = _code_blocks(README, "bash")
    assert len(blocks) >= 2, "README.md: expected the main command's and the tests' bash blocks"
    (main_at, main), (tests_at, tests) = blocks[:2]
    assert [_command(line) for line in main if _command(line)] == [MAIN_COMMAND], \
        f"README.md: the first bash block (line {main_at}) must be exactly `{MAIN_COMMAND}`"
    assert _command(tests[0]) == TEST_COMMAND, \
        f"README.md: the second bash block (line {tests_at}) must start with `{TEST_COMMAND}`"
    sections = [number for number, level, _ in _headings(README) if level == 2]
    assert sections and sections[0] < main_at and (len(sections) == 1 or main_at < sections[1]), \
        "README.md: the main command belongs to the first ## section, right after the introduction"


def test_ci_runs_the_readmes_setup_then_its_test_command():
    """.ci/run is the README's setup (the first part of its first command) followed by the README's test command
    (the first line of its second shell block), and nothing after it."""
    (_, main), (_, tests) = _code_blocks(README, "bash")[:2]
    setup = _command(main[0]).split("&&")[0].strip()
    ci = [_command(line) for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    commands = [line for line in ci if line and not line.startswith(("#", "set ", "cd "))]
    assert commands[-2:] == [setup, _command(tests[0])], \
        f".ci/run runs {commands}; README.md's setup and test command are {[setup, _command(tests[0])]}"


# ----------------------------------------------------------------------------------------------------------------------
# links and names


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@lru_cache(maxsize=None)
def _anchors(path: Path) -> frozenset[str]:
    """The anchors of ``path``'s headings, numbered as GitHub numbers repeated headings (-1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, _, text in _headings(path):
        slug = _slug(text)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(anchors)


def _link_problem(source: Path, target: str) -> Optional[str]:
    """Why the relative link ``target`` in ``source`` does not resolve, or None when it does (or is external)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
        return None  # http(s), mailto, ...: not checked offline
    path_part, _, anchor = target.partition("#")
    path = (source.parent / path_part).resolve() if path_part else source
    if not path.exists():
        return f"{path_part} does not exist"
    if REPO not in path.parents and path != REPO:
        return f"{path_part} is outside the repository"
    if anchor and path.suffix == ".md" and anchor not in _anchors(path):
        return f"{path.relative_to(REPO)} has no heading with anchor #{anchor}"
    return None


def _links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image of ``path`` outside code blocks."""
    prose = _prose(path)
    found = [(number, match.group(1)) for number, line in prose for match in LINK.finditer(line)]
    found += [(number, match.group(1)) for number, line in prose for match in LINK_DEFINITION.finditer(line)]
    return found


def test_link_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    assert _slug("The rollout: `hf` or verl's `vllm`") == "the-rollout-hf-or-verls-vllm"
    assert _link_problem(README, "docs/cpu.md#the-rollout-hf-or-verls-vllm") is None
    assert _link_problem(README, "https://example.org/nowhere") is None
    assert "does not exist" in _link_problem(README, "docs/no_such_page.md")
    assert "no heading with anchor #no-such-section" in _link_problem(README, "docs/cpu.md#no-such-section")
    assert "no heading" in _link_problem(README, "#no-such-section")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```bash\n# not a heading\n```\n\n[a](#title) [b](<#not-a-heading>)\n")
    assert [target for _, target in _links(page)] == ["#title", "#not-a-heading"]
    assert _anchors(page) == {"title"}


@pytest.mark.parametrize("path", MANUAL, ids=lambda p: p.name)
def test_every_relative_link_resolves(path: Path) -> None:
    links = _links(path)
    broken = [f"{path.name}:{number}: ({target}) {problem}" for number, target in links
              for problem in [_link_problem(path, target)] if problem]
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def _module_file(parts: list[str]) -> Optional[Path]:
    """The source file of the module ``parts`` (a package's ``__init__.py``), or None when there is none."""
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def _top_level_names(path: Path) -> frozenset[str]:
    """The names ``path`` defines or imports at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return frozenset(names)


def _dotted_problem(name: str) -> Optional[str]:
    """Why the dotted ``verl_group_ppo.x.y`` names no module of the package or top-level object of one (read from
    the source, nothing imported), or None when it does."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        source = _module_file(parts[:split])
        if source is None:
            continue
        rest = parts[split:]
        if rest and re.fullmatch(r"__\w+__", rest[0]):
            return None  # a module attribute every module has (__file__, __version__ is defined, ...)
        if rest and rest[0] not in _top_level_names(source) and _module_file(parts[:split + 1]) is None:
            return f"{'.'.join(parts[:split])} has no {rest[0]}"
        return None
    return "no such module"


def _named(path: Path, pattern: re.Pattern) -> list[tuple[int, str]]:
    return [(number, match.group(0).rstrip(".")) for number, line in enumerate(_lines(path), 1)
            for match in pattern.finditer(line)]


def test_name_checker_finds_a_missing_module_and_a_missing_object():
    assert _dotted_problem("verl_group_ppo.core_algos.compute_group_advantage") is None
    assert _dotted_problem("verl_group_ppo.rollout.server.HFRolloutServer.generate") is None
    assert _dotted_problem("verl_group_ppo.core_algos.no_such_function") == "verl_group_ppo.core_algos has no " \
                                                                             "no_such_function"
    assert _dotted_problem("verl_group_ppo.no_such_module") == "verl_group_ppo has no no_such_module"
    assert [name for _, name in _named(README, FILE_PATH)], "the file-path pattern finds what README names"


@pytest.mark.parametrize("path", MANUAL, ids=lambda p: p.name)
def test_every_named_module_object_and_file_exists(path: Path) -> None:
    missing = [f"{path.name}:{number}: {name}: {problem}" for number, name in _named(path, DOTTED)
               for problem in [_dotted_problem(name)] if problem]
    missing += [f"{path.name}:{number}: {name}: no such file or folder" for number, name in _named(path, FILE_PATH)
                if not (REPO / name).exists()]
    assert not missing, "names in the manual that do not exist:\n" + "\n".join(missing)


def test_every_python_m_module_exists() -> None:
    named = {m for path in MANUAL for m in MODULE.findall(path.read_text(encoding="utf-8"))}
    assert "verl_group_ppo.viz" in named  # the pattern finds what the docs name
    missing = sorted(m for m in named if _module_file(m.split(".")) is None)
    assert not missing, f"modules named with `python -m` in README/docs that do not exist: {missing}"


# ----------------------------------------------------------------------------------------------------------------------
# a manual, not a notebook


@pytest.mark.parametrize("path", MANUAL, ids=lambda p: p.name)
def test_no_diary_words_or_commit_hashes(path: Path) -> None:
    bad = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(_lines(path), 1)
           if DIARY.search(line) or HASH.search(line)]
    assert not bad, "diary words or commit hashes:\n" + "\n".join(bad)


def test_reproducing_states_the_recipes_critic_warmup() -> None:
    recipe = (REPO / "examples" / "group_ppo_trainer" / "common.sh").read_text(encoding="utf-8")
    in_recipe = set(re.findall(r"^\s*trainer\.critic_warmup=(\d+)", recipe, re.MULTILINE))
    assert len(in_recipe) == 2, f"common.sh sets critic_warmup to {in_recipe}; expected one value for the critics and 0"
    warmup = max(in_recipe, key=int)
    doc = (REPO / "docs" / "reproducing.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"trainer\.critic_warmup=(\d+)", doc)) - {"0"}
    assert documented == {warmup}, f"docs/reproducing.md gives critic_warmup {documented}, the recipes {warmup}"
