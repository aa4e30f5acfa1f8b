"""The house rules of the package (docs/architecture.md): short functions, no import cycle, a pure core.

Read from the source with ``ast``, so run-time imports inside functions count as much as top-level ones, and so do
modules named in strings (a dotted ``verl_group_ppo.x.y`` that Ray, vLLM, verl's ``pkg://`` paths or
``import_module`` import by name).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "verl_group_ppo"
MAX_FUNCTION_LINES = 60
CORE_MODULES = ("verl_group_ppo.core_algos", "verl_group_ppo.config", "verl_group_ppo.metrics",
                "verl_group_ppo.estimator.checks", "verl_group_ppo.estimator.fast", "verl_group_ppo.estimator.reference")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


DOTTED_NAME = re.compile(r"verl_group_ppo(?:\.[A-Za-z_]\w*)+")
"""A dotted name of one of our modules (or of an object in it) inside a string."""


def _named_in_strings(tree: ast.Module) -> list[str]:
    """Every dotted ``verl_group_ppo.x.y`` in the string constants of ``tree`` that are a name rather than prose (no
    whitespace): a class path for Ray or vLLM, a ``pkg://`` path, an f-string's literal part. A message or a
    docstring that mentions a module imports nothing."""
    return [match for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and not re.search(r"\s", node.value)
            for match in DOTTED_NAME.findall(node.value)]


def _imported_modules(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Our modules that ``name`` imports anywhere in its source (top level or inside functions), or names in a
    string."""
    package = name if any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in [*ast.walk(tree), *_named_in_strings(tree)]:
        targets: list[str] = []
        if isinstance(node, str):
            targets = [node]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]  # importlib.import_module("verl_group_ppo....")
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _import_graph() -> dict[str, set[str]]:
    sources = _sources()
    known = set(sources)
    return {name: _imported_modules(name, tree, known) for name, tree in sources.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of module names, or [] when the graph has none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def _parents_of_package(name: str) -> set[str]:
    """A package imports its parents implicitly; those edges are not cycles of ours."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycle_including_run_time_imports():
    graph = {name: {t for t in targets if t not in _parents_of_package(name)} for name, targets in _import_graph().items()}
    assert _cycle(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_run_time_imports_are_seen():
    tree = ast.parse("def f():\n    import importlib\n    importlib.import_module('verl_group_ppo.x')\n"
                     "    from verl_group_ppo import y\n")
    assert _imported_modules("verl_group_ppo.z", tree, {"verl_group_ppo.x", "verl_group_ppo.y",
                                                        "verl_group_ppo.z"}) == {"verl_group_ppo.x", "verl_group_ppo.y"}


def test_modules_named_in_strings_are_seen_and_prose_is_not():
    tree = ast.parse('"""Docs name verl_group_ppo.d, which imports nothing."""\n'
                     'SERVER = "verl_group_ppo.x.Server"  # Ray or vLLM imports it by name\n'
                     'REWARD = f"pkg://verl_group_ppo.y.{SERVER}"\n'
                     'def f():\n    raise ValueError("rows come from verl_group_ppo.d")\n'
                     'def g():\n    return "verl_group_ppo.z"\n')
    known = {"verl_group_ppo.x", "verl_group_ppo.y", "verl_group_ppo.z", "verl_group_ppo.d", "verl_group_ppo.w"}
    assert _imported_modules("verl_group_ppo.w", tree, known) == {"verl_group_ppo.x", "verl_group_ppo.y",
                                                                   "verl_group_ppo.z"}
    graph = {"verl_group_ppo.w": _imported_modules("verl_group_ppo.w", tree, known),
             "verl_group_ppo.x": {"verl_group_ppo.w"}}  # x imports w, w names x in a string: a cycle
    assert _cycle(graph) == ["verl_group_ppo.w", "verl_group_ppo.x", "verl_group_ppo.w"]


def test_core_imports_no_glue_demo_or_verl_trainer():
    for name in CORE_MODULES:
        tree = _sources()[name]
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        ours = {m for m in imported if m.startswith("verl_group_ppo")}
        assert ours <= set(CORE_MODULES), f"{name} imports {ours - set(CORE_MODULES)}"
        assert not any(m == "verl" or m.startswith("verl.") for m in imported), f"{name} imports verl"


def _long_functions() -> list[str]:
    found = []
    for name, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}.{node.name} ({length} lines)")
    return found


def test_no_function_over_60_lines():
    assert _long_functions() == []


def test_mission_names_stay_importable_from_core_algos_and_do_what_the_card_says():
    """The design card's three names, from ``verl_group_ppo.core_algos``, on one response of 5 tokens cut every 2
    tokens (groups [0, 1], [2, 3], [4]), worked by hand with gamma = lam = 1 and no normalisation: the group
    advantage is the rewards to the response's end minus V at the group's first token."""
    import torch

    from verl_group_ppo.core_algos import (compute_group_advantage, create_critic_endpoint_mask,
                                           find_group_endpoints)

    rewards, mask = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0]]), torch.ones(1, 5)
    values = torch.tensor([[0.5, 0.0, 0.0, 0.0, 0.0]])
    ends = find_group_endpoints(rewards, mask, boundary_rule="fixed", group_max_size=2)
    assert ends.tolist() == [[False, True, False, True, True]]
    critic_mask = create_critic_endpoint_mask(mask, torch.tensor([[1, 1, 2, 2, 3]]))
    assert critic_mask.tolist() == [[1.0, 0.0, 1.0, 0.0, 1.0]]
    config = {"gamma": 1.0, "lam": 1.0, "group_params": {"boundary_rule": "fixed", "group_max_size": 2,
                                                         "adv_norm": "none", "policy_lam": 1.0}}
    advantages, returns = compute_group_advantage(rewards, mask, values=values, config=config)
    assert advantages.tolist() == [[2.5, 2.5, 3.0, 3.0, 2.0]]
    assert returns.tolist() == [[3.0, 3.0, 3.0, 2.0, 2.0]]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (run-time imports included)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_reachable_follows_imports_transitively():
    assert _reachable({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}, "a") == {"b", "c"}


@pytest.mark.parametrize("package,forbidden", [
    # verl's only
    ("verl_group_ppo.cpu", ("verl_group_ppo.tasks", "verl_group_ppo.rollout")),
    # any verl run's, any platform's
    ("verl_group_ppo.rollout", ("verl_group_ppo.tasks", "verl_group_ppo.integration")),
    ("verl_group_ppo.tasks.tiny", ("verl_group_ppo.cpu", "verl_group_ppo.tasks.maths")),  # alone
    ("verl_group_ppo.tasks.maths", ("verl_group_ppo.tasks.tiny", "verl_group_ppo.integration")),
    # the tasks' room imports no verl glue
    ("verl_group_ppo.tasks", ("verl_group_ppo.integration",)),
])
def test_package_reaches_none_of_the_forbidden_ones(package, forbidden):
    graph = _import_graph()
    for name in (m for m in graph if _in_package(m, package)):
        bad = {m for m in _reachable(graph, name) if any(_in_package(m, f) for f in forbidden)}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_the_maths_task_uses_only_the_hf_rollouts_sampling_and_nothing_of_the_cpu_backend():
    # prepare measures the model as the hf rollout samples (its batch and the batch's prefix cache); nothing else of
    # the rollout, nothing of the backend
    graph = _import_graph()
    reached = {m for name in graph if _in_package(name, "verl_group_ppo.tasks.maths") for m in _reachable(graph, name)}
    assert {m for m in reached if _in_package(m, "verl_group_ppo.rollout")} == {
        "verl_group_ppo.rollout.generation", "verl_group_ppo.rollout.prefix_cache"}
    assert not {m for m in reached if _in_package(m, "verl_group_ppo.cpu")}


def test_the_hf_rollouts_registration_imports_only_the_standard_library():
    """verl_group_ppo.rollout registers the rollout by name in every verl process: importing it must load nothing of
    the rollout (nor torch, ray or verl)."""
    import sys

    tree = _sources()["verl_group_ppo.rollout"]
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and not {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"}}


def test_the_package_imports_neither_the_experiments_nor_the_benchmarks():
    """The package is the plugin, the backend and the tasks: the demo's RL loop (``experiments/``) and the
    benchmarks sit outside it and only import it."""
    outside = ("experiments", "benchmarks")
    found = [f"{name}: {target}" for name, tree in _sources().items() for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
             for target in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
             if target.split(".")[0] in outside]
    assert found == []


def _modules_loaded_by(statement: str) -> set[str]:
    """The ``verl_group_ppo`` modules a fresh interpreter holds after running ``statement``."""
    import subprocess
    import sys

    code = f"import sys\n{statement}\nprint('\\n'.join(m for m in sys.modules if m.startswith('verl_group_ppo')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE.parent, check=True).stdout
    return set(out.split())


@pytest.mark.slow
def test_the_reward_function_loads_not_the_cpu_backend():
    loaded = _modules_loaded_by("from verl_group_ppo.tasks.reward import compute_score")
    assert {"verl_group_ppo.tasks.tiny.reward", "verl_group_ppo.tasks.maths.reward"} <= loaded
    assert not {m for m in loaded if _in_package(m, "verl_group_ppo.cpu")}


@pytest.mark.slow
def test_quick_tests_that_start_a_process_fail(tmp_path):
    """tests/conftest.py fails an unmarked test that starts a subprocess, and marks ray_tq users slow."""
    import shutil
    import subprocess
    import sys

    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_tiers.py").write_text(
        "import subprocess, sys, pytest\n"
        "def test_unmarked():\n    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
        "@pytest.mark.slow\ndef test_marked():\n    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
        "def test_quiet():\n    assert True\n"
        "def test_ray_user(request, ray_tq):\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "not slow", "-rA",
                           "--import-mode=importlib", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert "PASSED test_tiers.py::test_quiet" in done.stdout, done.stdout[-3000:]
    assert "ERROR test_tiers.py::test_unmarked" in done.stdout, done.stdout[-3000:]
    assert "is not marked @pytest.mark.slow" in done.stdout
    assert "2 deselected" in done.stdout  # test_marked, and test_ray_user through its ray_tq fixture


def test_modules_that_share_the_session_ray_run_last_each_whole_and_in_order():
    """tests/conftest.py runs the modules that use ray_tq after the others (main_ppo runs then start no process beside
    that session's Ray), each module's tests together and in their order, and the other modules' order kept."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("tiers_conftest", Path(__file__).with_name("conftest.py"))
    tiers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiers)
    collected = [("test_a.py::test_1", ("tmp_path",)), ("test_a.py::test_2", ("local_ray",)), ("test_r.py::test_1", ()),
                 ("test_r.py::test_2", ("ray_tq",)), ("test_r.py::test_3[x]", ()), ("test_b.py::test_1", ()),
                 ("test_s.py::test_1", ("ray_tq",)), ("test_c.py::test_1", ())]
    items = [SimpleNamespace(nodeid=f"tests/{name}", fixturenames=fixtures) for name, fixtures in collected]
    assert [item.nodeid.removeprefix("tests/") for item in tiers.shared_ray_modules_last(items)] == [
        "test_a.py::test_1", "test_a.py::test_2", "test_b.py::test_1", "test_c.py::test_1",
        "test_r.py::test_1", "test_r.py::test_2", "test_r.py::test_3[x]", "test_s.py::test_1"]
