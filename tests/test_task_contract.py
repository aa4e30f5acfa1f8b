"""The task contract: a prepared task directory (``verl_group_ppo.taskdir``), the tasks' specs
(``verl_group_ppo.task_specs``) and the one reward function (``verl_group_ppo.reward``)."""

from __future__ import annotations

import ast
import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from verl_group_ppo import reward, task_specs, taskdir
from verl_group_ppo.mathtask import prepare as mathtask_prepare
from verl_group_ppo.mathtask import reward as mathtask_reward
from verl_group_ppo.tinytask import prepare as tiny_prepare
from verl_group_ppo.tinytask import reward as tiny_reward
from verl_group_ppo.tinytask.tasks import make_task, split_problems

PACKAGE = Path(__file__).resolve().parents[1] / "verl_group_ppo"


@dataclass(frozen=True)
class Settings:
    size: int = taskdir.setting(3, "how many")
    name: str = taskdir.setting("a", "what it is called")


def _write(output_dir: Path, settings: Settings, version: int = 1) -> None:
    def model(folder: str) -> None:
        Path(folder).mkdir()
        (Path(folder) / "config.json").write_text("{}")

    rows = {split: [{"data_source": "x", "index": i} for i in range(settings.size)] for split in taskdir.SPLITS}
    taskdir.write_task(str(output_dir), rows, {"format_version": version, "settings": {"size": settings.size,
                                                                                        "name": settings.name}}, model)


def test_a_task_is_prepared_when_its_outputs_and_key_hold_these_settings(tmp_path):
    import pandas as pd

    settings = Settings()
    assert not taskdir.is_prepared(str(tmp_path), settings, 1)
    _write(tmp_path, settings)
    assert taskdir.is_prepared(str(tmp_path), settings, 1)
    assert not taskdir.is_prepared(str(tmp_path), replace(settings, size=4), 1)
    assert not taskdir.is_prepared(str(tmp_path), settings, 2)
    assert len(pd.read_parquet(taskdir.data_path(str(tmp_path), "test"))) == 3
    assert json.loads((tmp_path / "data" / "prepare.json").read_text())["settings"] == {"size": 3, "name": "a"}
    assert not [p for p in tmp_path.rglob("*.tmp")]
    (tmp_path / "data" / "train.parquet").unlink()
    assert not taskdir.is_prepared(str(tmp_path), settings, 1)


def test_an_interrupted_write_leaves_no_key_file(tmp_path):
    _write(tmp_path, Settings())

    def broken(folder: str) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        taskdir.write_task(str(tmp_path), {"train": [{"a": 1}]}, {"format_version": 1}, broken)
    assert taskdir.read_key(str(tmp_path)) is None and not taskdir.is_prepared(str(tmp_path), Settings(), 1)
    assert (tmp_path / "model" / "config.json").exists()  # the old model stays until a new one is complete


def test_the_command_line_has_a_flag_per_setting_with_its_help_and_the_threads_rule():
    parser = taskdir.settings_parser(Settings, "prog", "what it does")
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["size"] == "how many (default: 3)" and helps["name"] == "what it is called (default: a)"
    call = taskdir.parse_prepare_args(parser, ["--output-dir", "d", "--size", "5"])
    assert call.flags == {"size": 5} and not call.force and call.threads >= 1 and Path(call.output_dir).is_absolute()
    assert taskdir.parse_prepare_args(parser, ["--output-dir", "d", "--threads", "1", "--force"]).threads == 1
    with pytest.raises(ValueError, match="--threads"):
        taskdir.parse_prepare_args(parser, ["--output-dir", "d", "--threads", "0"])


@pytest.mark.parametrize("module", [tiny_prepare, mathtask_prepare])
def test_both_prepares_use_the_contract_and_document_every_setting(module):
    flags = {a.dest: a.help for a in module.build_parser()._actions}
    assert {"output_dir", "force", "threads"} <= set(flags)
    settings = module.PrepareSettings()
    for name in settings.__dataclass_fields__:
        help_text = flags[name]
        assert help_text and not help_text.startswith("(default"), (name, help_text)


ONCE = {"is_prepared": "taskdir.py", "write_task": "taskdir.py", "settings_parser": "taskdir.py",
        "write_file": "taskdir.py", "replace_dir": "taskdir.py", "critic_values": "critic_readout.py",
        "heldout_explained_variance": "critic_readout.py", "lay_out": "critic_readout.py"}


def test_the_contract_and_the_critic_readout_are_defined_once_in_the_package():
    """Each function of ONCE is defined in one module only, and no module but taskdir renames a file into place,
    writes a parquet file or builds a --threads or --force flag."""
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
        "to_parquet": ["taskdir.py"], "os.replace(": ["taskdir.py"], '"--threads"': ["taskdir.py"],
        '"--force"': ["taskdir.py"]}


def test_the_specs_read_what_their_prepare_also_uses():
    tiny, tools, twoway = task_specs.TINY, task_specs.TINY_TOOLS, task_specs.TWOWAY
    assert tiny.response_length == tiny_prepare.PrepareSettings().response_length
    tool_settings = tiny_prepare.settings_from_flags({"variant": "tools"})
    assert (tools.response_length, tools.max_assistant_turns) == (tool_settings.response_length,
                                                                  tool_settings.max_assistant_turns)
    s = mathtask_prepare.settings_from_flags({"variant": "twoway"})
    assert (twoway.response_length, twoway.prompt_length) == (s.response_length, s.max_prompt_length)
    assert twoway.accuracy_band == (s.min_sampled_accuracy, s.max_sampled_accuracy)
    assert [task_specs.spec_for(t, m) for t, m in (("tiny", 0), ("tiny", "1"), ("twoway", "0"))] == [
        tiny, tools, twoway]
    for bad, name in [(("big", 0), "TASK"), (("twoway", 1), "MULTI_TURN"), (("tiny", 2), "MULTI_TURN")]:
        with pytest.raises(ValueError, match=name):
            task_specs.spec_for(*bad)


def test_a_spec_refuses_mini_batches_that_do_not_divide_the_batch():
    with pytest.raises(ValueError, match="critic_mini_batches"):
        replace(task_specs.TWOWAY, critic_mini_batches=3)
    with pytest.raises(ValueError, match="max_assistant_turns"):
        replace(task_specs.TINY, multi_turn=True)


def test_the_shell_assignments_quote_every_value():
    text = task_specs.shell_assignments(replace(task_specs.TINY, project="a b;c", prepare_args=("--x", "y z")))
    values = dict(line.split("=", 1) for line in text.splitlines())
    assert shlex.split(values["project"]) == ["a b;c"] and values["prepare_args"] == "(--x 'y z')"
    assert values["response_length"] == "24" and values["val_before_train"] == "False"
    assert values["rank_unit"] == str(task_specs.TINY.rank_unit) == "64"
    assert "tool_file" not in values and "tool_file" in task_specs.shell_values(task_specs.TINY_TOOLS)


def test_the_one_reward_function_scores_every_tasks_rows_as_its_own_scorer_does():
    task = make_task("chain_sum")
    problem = split_problems(task, 20, 4)[1][0]
    row = tiny_prepare.verl_row(problem, task, "test", 0)
    args = (problem.solution, problem.answer, row["extra_info"])
    assert reward.compute_score(row["data_source"], *args) == tiny_reward.compute_score(row["data_source"], *args) == 1.0
    for source in task_specs.TWOWAY.data_sources:
        assert reward.compute_score(source, "It is 7.", "7") == mathtask_reward.compute_score(source, "It is 7.", "7")
    for spec in task_specs.SPECS:
        for source in spec.data_sources:
            assert source in tiny_reward.DATA_SOURCES | mathtask_reward.DATA_SOURCES
    with pytest.raises(ValueError, match="data_source"):
        reward.compute_score("openai/gsm8k", "7", "7")
