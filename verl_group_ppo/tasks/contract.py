"""The task contract: what every task folder provides, what a launcher run of it is, what its prepared directory
holds and the prepare command line every task shares.

A task is one folder under ``verl_group_ppo/tasks/`` with the same files:

* ``spec.py``: its launcher runs (:class:`TaskSpec`, one per ``TASK``/``MULTI_TURN`` pair) and its :class:`Task`
  record ``TASK``, which :data:`verl_group_ppo.tasks.registry.TASKS` lists;
* ``variants.py``: its variants, one :class:`Variant` record each in ``VARIANTS`` (by name), picked by the prepare
  settings' ``variant`` (``--variant``); a variant holds the settings whose defaults differ for it and what the
  task does differently for it;
* ``prepare.py``: ``python -m verl_group_ppo.tasks.<name>.prepare --output-dir DIR`` (a settings dataclass read
  through :func:`settings_parser`, :func:`settings_from_flags` and :func:`run_prepare_command`), writing the
  directory below;
* ``reward.py``: ``DATA_SOURCES`` (every ``data_source`` its rows carry) and ``compute_score``, the scorer of one
  row that the one reward function (:mod:`verl_group_ppo.tasks.reward`) hands the task's rows to.

Every task is prepared into one directory of the same shape::

    WORK_DIR/model/                     the Hugging Face checkpoint actor and critic start from
    WORK_DIR/data/train.parquet         verl's rows (data_source, prompt, reward_model, extra_info)
    WORK_DIR/data/test.parquet
    WORK_DIR/data/prepare.json          the key file, written last: format version, settings, what prepare measured

This module is the one place for that shape: :func:`is_prepared` (the outputs exist and the key file holds these
settings) and :func:`write_task` (through the atomic writes of :mod:`verl_group_ppo.files`). It imports nothing of
the package but :mod:`verl_group_ppo.files`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..files import replace_dir, write_json, write_parquet

MODEL_DIR = "model"
DATA_DIR = "data"
SPLITS = ("train", "test")
#: the key file, relative to the task directory (the same place for every task)
KEY_FILE = os.path.join(DATA_DIR, "prepare.json")
#: the help of ``--threads``: the one rule of how many torch threads a prepare uses
THREADS_HELP = ("torch threads (default: 2 when the machine has 2 cores or more, else 1; use 1 on a machine whose "
                "cores are busy with other work)")


@dataclass(frozen=True)
class TaskSpec:
    """What the CPU launcher (examples/cpu/common.sh) and the benchmarks need to know of one launcher run of a task;
    each number is written once, in the task's ``spec.py`` or as its prepare settings' default (which the spec
    reads)."""

    name: str  # the task's label: trainer.experiment_name is NAME_ESTIMATOR
    task: str  # the launcher's TASK value
    multi_turn: bool  # the launcher's MULTI_TURN value: verl's tool agent loop
    data_sources: tuple[str, ...]  # the data_source of its rows (the reward dispatches on it)
    prepare_module: str  # run as python -m PREPARE_MODULE --output-dir WORK_DIR PREPARE_ARGS...
    prepare_args: tuple[str, ...]  # the flags the launcher gives prepare
    work_dir: str  # default WORK_DIR, relative to the repository root
    prompt_length: int  # data.max_prompt_length (tokens)
    response_length: int  # data.max_response_length (tokens)
    train_batch: int  # prompts per step (data.train_batch_size)
    rollout_n: int  # responses per prompt
    steps: int  # trainer.total_training_steps
    actor_lr: float  # actor_rollout_ref.actor.optim.lr
    critic_lr: float  # critic.optim.lr
    actor_mini_batches: int  # actor updates per step (the train batch split in this many mini-batches)
    critic_mini_batches: int  # critic updates per step
    val_before_train: bool  # verl validates on the test split before the first step
    test_freq: int  # verl validates every this many steps (-1: never)
    threads: int  # OMP threads of every process of the run
    project: str  # trainer.project_name
    accuracy_band: tuple[float, float]  # prepare refuses a model whose sampled accuracy is outside it
    max_assistant_turns: int = 0  # multi-turn: the agent loop's turn limit (0: single-turn)
    value_group_size: int = 4  # group_max_size of the launcher's runs with value_source mc or prefix_tree
    temperature: float = 1.0  # actor_rollout_ref.rollout.temperature (sampling, and the actor's log-probs)
    tool_module: str = ""  # multi-turn: the module whose file verl's tool agent loop executes (function tools)

    def __post_init__(self) -> None:
        for name in ("train_batch", "rollout_n", "steps", "actor_mini_batches", "critic_mini_batches", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("actor_mini_batches", "critic_mini_batches"):
            if self.train_batch % getattr(self, name):
                raise ValueError(f"{name}: must divide train_batch={self.train_batch}, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if self.multi_turn != (self.max_assistant_turns > 0):
            raise ValueError(f"max_assistant_turns: must be > 0 exactly for a multi-turn task, got "
                             f"{self.max_assistant_turns} (multi_turn={self.multi_turn})")
        if self.multi_turn != bool(self.tool_module):
            raise ValueError(f"tool_module: must be given exactly for a multi-turn task, got {self.tool_module!r} "
                             f"(multi_turn={self.multi_turn})")

    @property
    def actor_mini_batch(self) -> int:
        """Prompts per actor mini-batch (actor.ppo_mini_batch_size)."""
        return self.train_batch // self.actor_mini_batches

    @property
    def critic_mini_batch(self) -> int:
        """Prompts per critic mini-batch (critic.ppo_mini_batch_size)."""
        return self.train_batch // self.critic_mini_batches

    @property
    def rank_unit(self) -> int:
        """Responses in the smallest mini-batch: the trainer ranks must divide it."""
        return min(self.actor_mini_batch, self.critic_mini_batch) * self.rollout_n


@dataclass(frozen=True)
class Variant:
    """One variant of a task: its name (the prepare settings' ``variant``, ``--variant``) and the settings whose
    defaults differ for it. A task's ``variants.py`` derives its own record from this one, adding what the task
    does differently per variant, and lists them in ``VARIANTS`` by name."""

    name: str
    defaults: Mapping[str, Any]  # setting name -> this variant's default (the settings dataclass holds the rest)


@dataclass(frozen=True)
class Task:
    """What the package knows of one task folder (its ``spec.TASK``): :data:`verl_group_ppo.tasks.registry.TASKS` lists
    these, and the launcher, the one reward function and its start-up check read nothing else."""

    name: str  # the folder under verl_group_ppo/tasks/
    specs: tuple[TaskSpec, ...]  # its launcher runs
    data_sources: frozenset[str]  # every data_source its rows carry (the reward dispatches on it)
    compute_score: Callable[..., float | dict[str, float]]  # verl's reward of one of its rows (reward.compute_score)
    scorer_modules: tuple[str, ...] = ()  # modules its scorer imports beyond verl-group-ppo's requirements
    extra: str = ""  # the extra of verl-group-ppo that installs scorer_modules

    def __post_init__(self) -> None:
        if not self.specs:
            raise ValueError(f"specs: task {self.name!r} has no launcher run")
        if self.scorer_modules and not self.extra:
            raise ValueError(f"extra: task {self.name!r} names scorer modules but no extra that installs them")
        missing = sorted({s for spec in self.specs for s in spec.data_sources} - self.data_sources)
        if missing:
            raise ValueError(f"data_sources: task {self.name!r} lacks {missing}, which its specs' rows carry")


# ------------------------------------------------------------------------------------------ the directory

def model_dir(output_dir: str) -> str:
    return os.path.join(output_dir, MODEL_DIR)


def data_path(output_dir: str, split: str) -> str:
    """``output_dir/data/<split>.parquet``."""
    return os.path.join(output_dir, DATA_DIR, f"{split}.parquet")


def key_path(output_dir: str) -> str:
    return os.path.join(output_dir, KEY_FILE)


def read_key(output_dir: str) -> dict | None:
    """The key file's contents, or None when it is missing or unreadable."""
    try:
        with open(key_path(output_dir)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_prepared(output_dir: str, settings: Any, format_version: int) -> bool:
    """True when ``output_dir`` holds the model (its ``config.json``), both splits and a key file written by
    ``format_version`` with ``settings`` (a dataclass)."""
    needed = [os.path.join(model_dir(output_dir), "config.json"), *(data_path(output_dir, s) for s in SPLITS)]
    if not all(os.path.exists(p) for p in needed):
        return False
    saved = read_key(output_dir)
    return (saved is not None and saved.get("format_version") == format_version
            and saved.get("settings") == dataclasses.asdict(settings))


def write_task(output_dir: str, rows: Mapping[str, Sequence[Mapping[str, Any]]], key: Mapping[str, Any],
               write_model: Callable[[str], None] | None = None) -> None:
    """Write a prepared task: the key file is removed first, then each split's ``rows`` ({split: rows}) and the
    model (``write_model(folder)``, where given, through :func:`replace_dir`) are written, and ``key`` last. An
    interrupted write leaves no key file, so :func:`is_prepared` is False until a write completes."""
    if os.path.exists(key_path(output_dir)):
        os.remove(key_path(output_dir))
    for split, split_rows in rows.items():
        write_parquet(data_path(output_dir, split), split_rows)
    if write_model is not None:
        replace_dir(model_dir(output_dir), write_model)
    write_json(key_path(output_dir), dict(key))


# ------------------------------------------------------------------------------------------ command line

def setting(default: Any, help: str) -> Any:  # noqa: A002 (argparse's word)
    """A settings-dataclass field with its one-line help (the command line shows it)."""
    return field(default=default, metadata={"help": help})


def settings_parser(settings_type: type, prog: str, description: str,
                    variants: Mapping[str, Variant] | None = None) -> argparse.ArgumentParser:
    """The prepare command line of ``settings_type`` (a dataclass of defaults): ``--output-dir``, one ``--flag`` per
    field (its help, then its default and each of ``variants``' own where it differs; ``--variant`` chooses among
    ``variants``), ``--force`` and ``--threads``. A flag not given parses to None."""
    variants = variants or {}
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--output-dir", required=True, help="the task directory: model/ and data/ are written there")
    defaults = settings_type()
    for f in dataclasses.fields(settings_type):
        default = getattr(defaults, f.name)
        own = [f"{v.defaults[f.name]} with --variant {name}" for name, v in variants.items() if f.name in v.defaults]
        note = f"(default: {'; '.join([str(default)] + own)})"
        choices = sorted(variants) if f.name == "variant" and variants else None
        p.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=None, choices=choices,
                       help=" ".join(filter(None, (f.metadata.get("help"), note))))
    p.add_argument("--force", action="store_true", help="rebuild even when the outputs are up to date")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    return p


@dataclass(frozen=True)
class PrepareCall:
    """A parsed prepare command line: where, whether to rebuild, torch threads, and the settings flags given."""

    output_dir: str  # absolute
    force: bool  # rebuild even when up to date
    threads: int  # torch threads (the --threads rule applied)
    flags: dict[str, Any]  # the settings flags given (a flag not given is left out)


def settings_from_flags(settings_type: type, variants: Mapping[str, Variant], flags: Mapping[str, Any]) -> Any:
    """``settings_type`` (a dataclass with a ``variant`` field) from parsed flags: a flag not given (None) takes its
    default, the variant's own (``variants[variant].defaults``) where it has one. An unknown variant gets the
    dataclass defaults (the settings' own check names it)."""
    given = {key: value for key, value in flags.items() if value is not None}
    variant = variants.get(given.get("variant", getattr(settings_type, "variant")))
    return settings_type(**{**(variant.defaults if variant is not None else {}), **given})


def run_prepare_command(parser: argparse.ArgumentParser, make_settings: Callable[[Mapping[str, Any]], Any],
                        prepare: Callable[..., Any], argv: Sequence[str] | None = None) -> int:
    """A task's ``prepare`` command line: parse ``argv`` (:func:`parse_prepare_args`), set torch's threads, then
    ``prepare(output_dir, make_settings(flags), log=print, force=...)``; returns the exit status 0."""
    call = parse_prepare_args(parser, argv)
    import torch

    torch.set_num_threads(call.threads)
    prepare(call.output_dir, make_settings(call.flags), log=lambda m: print(m, flush=True), force=call.force)
    return 0


def parse_prepare_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> PrepareCall:
    """Parse ``argv`` with a :func:`settings_parser`; ValueError naming ``--threads`` when it is below 1."""
    args = vars(parser.parse_args(argv))
    output_dir, force, threads = args.pop("output_dir"), args.pop("force"), args.pop("threads")
    threads = min(2, os.cpu_count() or 1) if threads is None else threads
    if threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {threads}")
    return PrepareCall(os.path.abspath(output_dir), force, threads,
                       {key: value for key, value in args.items() if value is not None})
