"""The README and docs/ read as a manual: short where promised, no diary words or commit hashes, every
`python -m verl_group_ppo.X` they name exists, and the recipes' critic warm-up is the one documented."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MANUAL = [README, *DOCS]
MAIN_COMMAND = "bash scripts/setup.sh && bash examples/cpu/run_tiny_group_ppo.sh"

#: words of a lab notebook, not a manual (whole words, any case)
DIARY = re.compile(r"\b(sessions?|earlier|scratch)\b", re.IGNORECASE)
#: a commit hash: 7-40 hex digits with at least one letter and one digit
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
MODULE = re.compile(r"python -m (verl_group_ppo(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = _lines(README)
    assert len(lines) <= 150, f"README.md has {len(lines)} lines, at most 150"
    first = "\n".join(lines[:40])
    assert MAIN_COMMAND in first, "README.md: setup and the main command must be within its first 40 lines"


def test_cpu_doc_is_a_short_how_to() -> None:
    n = len(_lines(REPO / "docs" / "cpu.md"))
    assert n <= 250, f"docs/cpu.md has {n} lines, at most 250"


@pytest.mark.parametrize("path", MANUAL, ids=lambda p: p.name)
def test_no_diary_words_or_commit_hashes(path: Path) -> None:
    bad = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(_lines(path), 1)
           if DIARY.search(line) or HASH.search(line)]
    assert not bad, "diary words or commit hashes:\n" + "\n".join(bad)


def test_every_named_module_exists() -> None:
    named = {m for path in MANUAL for m in MODULE.findall(path.read_text(encoding="utf-8"))}
    assert "verl_group_ppo.viz" in named  # the pattern finds what the docs name
    missing = sorted(m for m in named if importlib.util.find_spec(m) is None)
    assert not missing, f"modules named with `python -m` in README/docs that do not exist: {missing}"


def test_reproducing_states_the_recipes_critic_warmup() -> None:
    recipe = (REPO / "examples" / "group_ppo_trainer" / "common.sh").read_text(encoding="utf-8")
    in_recipe = set(re.findall(r"^\s*trainer\.critic_warmup=(\d+)", recipe, re.MULTILINE))
    assert len(in_recipe) == 2, f"common.sh sets critic_warmup to {in_recipe}; expected one value for the critics and 0"
    warmup = max(in_recipe, key=int)
    doc = (REPO / "docs" / "reproducing.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"trainer\.critic_warmup=(\d+)", doc)) - {"0"}
    assert documented == {warmup}, f"docs/reproducing.md gives critic_warmup {documented}, the recipes {warmup}"
