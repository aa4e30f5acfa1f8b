"""The task contract (``verl_group_ppo.tasks.contract``): every task folder's files and record, the task list, a
prepared task directory, the tasks' launcher specs (``verl_group_ppo.tasks.launcher``) and the one reward function
(``verl_group_ppo.tasks.reward``)."""

from __future__ import annotations

import ast
import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from verl_group_ppo.tasks import contract, launcher, reward
from verl_group_ppo.tasks.registry import TASKS
from verl_group_ppo.tasks.maths import spec as maths_spec
from verl_group_ppo.tasks.tiny import spec as tiny_spec
from verl_group_ppo.tasks.maths import prepare as maths_prepare
from verl_group_ppo.tasks.maths import reward as maths_reward
from verl_group_ppo.tasks.tiny import prepare as tiny_prepare
from verl_group_ppo.tasks.tiny import variants as tiny_variants
from verl_group_ppo.tasks.tiny import reward as tiny_reward
from verl_group_ppo.tasks.tiny.problems import make_task, split_problems

PACKAGE = Path(__file__).resolve().parents[1] / "verl_group_ppo"


@dataclass(frozen=True)
class Settings:
    size: int = contract.setting(3, "how many")
    name: str = contract.setting("a", "what it is called")


def _write(output_dir: Path, settings: Settings, version: int = 1) -> None:
    def model(folder: str) -> None:
        Path(folder).mkdir()
        (Path(folder) / "config.json").write_text("{}")

    rows = {split: [{"data_source": "x", "index": i} for i in range(settings.size)] for split in contract.SPLITS}
    contract.write_task(str(output_dir), rows, {"format_version": version, "settings": {"size": settings.size,
                                                                                        "name": settings.name}}, model)


def test_a_task_is_prepared_when_its_outputs_and_key_hold_these_settings(tmp_path):
    import pandas as pd

    settings = Settings()
    assert not contract.is_prepared(str(tmp_path), settings, 1)
    _write(tmp_path, settings)
    assert contract.is_prepared(str(tmp_path), settings, 1)
    assert not contract.is_prepared(str(tmp_path), replace(settings, size=4), 1)
    assert not contract.is_prepared(str(tmp_path), settings, 2)
    assert len(pd.read_parquet(contract.data_path(str(tmp_path), "test"))) == 3
    assert json.loads((tmp_path / "data" / "prepare.json").read_text())["settings"] == {"size": 3, "name": "a"}
    assert not [p for p in tmp_path.rglob("*.tmp")]
    (tmp_path / "data" / "train.parquet").unlink()
    assert not contract.is_prepared(str(tmp_path), settings, 1)


def test_an_interrupted_write_leaves_no_key_file(tmp_path):
    _write(tmp_path, Settings())

    def broken(folder: str) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        contract.write_task(str(tmp_path), {"train": [{"a": 1}]}, {"format_version": 1}, broken)
    assert contract.read_key(str(tmp_path)) is None and not contract.is_prepared(str(tmp_path), Settings(), 1)
    assert (tmp_path / "model" / "config.json").exists()  # the old model stays until a new one is complete


def test_the_command_line_has_a_flag_per_setting_with_its_help_and_the_threads_rule():
    parser = contract.settings_parser(Settings, "prog", "what it does")
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["size"] == "how many (default: 3)" and helps["name"] == "what it is called (default: a)"
    call = contract.parse_prepare_args(parser, ["--output-dir", "d", "--size", "5"])
    assert call.flags == {"size": 5} and not call.force and call.threads >= 1 and Path(call.output_dir).is_absolute()
    assert contract.parse_prepare_args(parser, ["--output-dir", "d", "--threads", "1", "--force"]).threads == 1
    with pytest.raises(ValueError, match="--threads"):
        contract.parse_prepare_args(parser, ["--output-dir", "d", "--threads", "0"])


@pytest.mark.parametrize("module", [tiny_prepare, maths_prepare])
def test_both_prepares_use_the_contract_and_document_every_setting(module):
    flags = {a.dest: a.help for a in module.build_parser()._actions}
    assert {"output_dir", "force", "threads"} <= set(flags)
    settings = module.PrepareSettings()
    for name in settings.__dataclass_fields__:
        help_text = flags[name]
        assert help_text and not help_text.startswith("(default"), (name, help_text)


ONCE = {"is_prepared": "contract.py", "write_task": "contract.py", "settings_parser": "contract.py",
        "write_file": "files.py", "replace_dir": "files.py", "critic_values": "critic_readout.py",
        "heldout_explained_variance": "critic_readout.py", "lay_out": "critic_readout.py"}


def test_the_contract_and_the_critic_readout_are_defined_once_in_the_package():
    """Each function of ONCE is defined in one module only, no module but files.py renames a file into place or
    writes a parquet file, and none but the contract builds a --threads or --force flag."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and node.name in ONCE:
                found.setdefault(node.name, []).append(path.name)
        for text in ("to_parquet", "os.replace(", '"--threads"', '"--force"'):
            if text in source:
                found.setdefault(text, []).append(path.name)
    assert {k: sorted(v) for k, v in found.items()} == {
        **{name: [module] for name, module in ONCE.items()},
        "to_parquet": ["files.py"], "os.replace(": ["files.py"], '"--threads"': ["contract.py"],
        '"--force"': ["contract.py"]}


def test_the_specs_read_what_their_prepare_also_uses():
    tiny, tools, twoway = tiny_spec.TINY, tiny_spec.TINY_TOOLS, maths_spec.TWOWAY
    assert tiny.response_length == tiny_prepare.PrepareSettings().response_length
    tool_settings = tiny_prepare.settings_from_flags({"variant": "tools"})
    assert (tools.response_length, tools.max_assistant_turns) == (tool_settings.response_length,
                                                                  tool_settings.max_assistant_turns)
    s = maths_prepare.settings_from_flags({"variant": "twoway"})
    assert (twoway.response_length, twoway.prompt_length) == (s.response_length, s.max_prompt_length)
    assert twoway.accuracy_band == (s.min_sampled_accuracy, s.max_sampled_accuracy)
    assert [launcher.spec_for(t, m) for t, m in (("tiny", 0), ("tiny", "1"), ("twoway", "0"))] == [
        tiny, tools, twoway]
    for bad, name in [(("big", 0), "TASK"), (("twoway", 1), "MULTI_TURN"), (("tiny", 2), "MULTI_TURN")]:
        with pytest.raises(ValueError, match=name):
            launcher.spec_for(*bad)


def test_a_spec_refuses_mini_batches_that_do_not_divide_the_batch():
    with pytest.raises(ValueError, match="critic_mini_batches"):
        replace(maths_spec.TWOWAY, critic_mini_batches=3)
    with pytest.raises(ValueError, match="max_assistant_turns"):
        replace(tiny_spec.TINY, multi_turn=True)


def test_the_shell_assignments_quote_every_value():
    text = launcher.shell_assignments(replace(tiny_spec.TINY, project="a b;c", prepare_args=("--x", "y z")))
    values = dict(line.split("=", 1) for line in text.splitlines())
    assert shlex.split(values["project"]) == ["a b;c"] and values["prepare_args"] == "(--x 'y z')"
    assert values["response_length"] == "24" and values["val_before_train"] == "False"
    assert values["rank_unit"] == str(tiny_spec.TINY.rank_unit) == "64"
    assert "tool_file" not in values and "tool_file" in launcher.shell_values(tiny_spec.TINY_TOOLS)


def test_the_one_reward_function_scores_every_tasks_rows_as_its_own_scorer_does():
    task = make_task("chain_sum")
    problem = split_problems(task, 20, 4)[1][0]
    row = tiny_variants.verl_row(problem, task, "test", 0)
    args = (problem.solution, problem.answer, row["extra_info"])
    assert reward.compute_score(row["data_source"], *args) == tiny_reward.compute_score(row["data_source"], *args) == 1.0
    for source in maths_spec.TWOWAY.data_sources:
        assert reward.compute_score(source, "It is 7.", "7") == maths_reward.compute_score(source, "It is 7.", "7")
    for spec in launcher.SPECS:
        for source in spec.data_sources:
            assert source in tiny_reward.DATA_SOURCES | maths_reward.DATA_SOURCES
    with pytest.raises(ValueError, match="data_source"):
        reward.compute_score("openai/gsm8k", "7", "7")


# ----------------------------------------------------------------------------------------------------------------------
# one task shape: the same files in every folder, one record each, one list


CONTRACT_FILES = ("__init__.py", "spec.py", "variants.py", "prepare.py", "reward.py")


def test_the_tasks_package_imports_nothing_so_a_prepare_runs_as_main_alone():
    tree = ast.parse((PACKAGE / "tasks" / "__init__.py").read_text())
    assert [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.module != "__future__"] == []


def test_every_task_folder_has_the_contract_files_and_is_in_the_list_once():
    folders = sorted(p.name for p in (PACKAGE / "tasks").iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(task.name for task in TASKS) == ["maths", "tiny"]
    for name in folders:
        missing = [f for f in CONTRACT_FILES if not (PACKAGE / "tasks" / name / f).exists()]
        assert missing == [], (name, missing)
    assert [task.name for task in TASKS] == ["tiny", "maths"]


@pytest.mark.parametrize("name", ["tiny", "maths"])
def test_each_folder_gives_its_record_variants_and_prepare_the_same_names(name):
    import importlib

    spec = importlib.import_module(f"verl_group_ppo.tasks.{name}.spec")
    variants = importlib.import_module(f"verl_group_ppo.tasks.{name}.variants")
    prepare = importlib.import_module(f"verl_group_ppo.tasks.{name}.prepare")
    task_reward = importlib.import_module(f"verl_group_ppo.tasks.{name}.reward")
    assert spec.TASK in TASKS and spec.TASK.compute_score is task_reward.compute_score
    assert spec.TASK.data_sources == task_reward.DATA_SOURCES
    assert all(isinstance(v, contract.Variant) and v.name == key for key, v in variants.VARIANTS.items())
    assert prepare.PrepareSettings().variant in variants.VARIANTS
    for key, variant in variants.VARIANTS.items():
        settings = prepare.settings_from_flags({"variant": key})
        assert {k: getattr(settings, k) for k in variant.defaults} == dict(variant.defaults)
    for run in spec.TASK.specs:
        assert run.prepare_module == f"verl_group_ppo.tasks.{name}.prepare"
        variant = run.prepare_args[1] if run.prepare_args[:1] == ("--variant",) else prepare.PrepareSettings().variant
        assert variant in variants.VARIANTS, (run.name, run.prepare_args)


def test_a_task_record_refuses_specs_whose_rows_it_cannot_score():
    tiny = TASKS[0]
    with pytest.raises(ValueError, match="data_sources"):
        replace(tiny, data_sources=frozenset())
    with pytest.raises(ValueError, match="specs"):
        replace(tiny, specs=())
    with pytest.raises(ValueError, match="extra"):
        replace(tiny, extra="")


def test_the_one_reward_function_dispatches_over_the_task_list():
    assert {reward.task_for(s).name for task in TASKS for s in task.data_sources} == {"tiny", "maths"}
    sources = [s for task in TASKS for s in task.data_sources]
    assert len(sources) == len(set(sources))  # no data source is two tasks'
    with pytest.raises(ValueError, match="^data_source: 'x' is not a task of verl_group_ppo"):
        reward.task_for("x")


def test_a_prepare_command_line_lists_every_variants_own_default():
    helps = {a.dest: a.help for a in maths_prepare.build_parser()._actions}
    assert "with --variant twoway" in helps["response_length"] and "twoway" not in helps["seed"]
    helps = {a.dest: a.help for a in tiny_prepare.build_parser()._actions}
    assert "96 with --variant tools" in helps["response_length"]
