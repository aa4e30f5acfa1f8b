"""Build the tiny real task for verl's ``main_ppo`` on CPU: a warm-started model and verl-format data.

    python -m verl_group_ppo.tasks.tiny.prepare --output-dir DIR [--variant tools]

writes

* ``DIR/model``: an HF Qwen2-architecture causal LM (the ``small`` size of :mod:`.model`) with a byte-level BPE
  tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer.json``; transformers loads it as ``Qwen2Tokenizer``)
  trained locally on the task's text (:mod:`.chat`), a ChatML chat template, EOS ``<|im_end|>`` and pad
  ``<|endoftext|>``. Its weights are the task's supervised warm start (:func:`.warmstart.warm_start`) on
  chat-templated prompts: a noisy reasoner that solves some problems when sampled, so RL has room to rise;
* ``DIR/data/train.parquet``, ``DIR/data/test.parquet``: verl's row format (:func:`.variants.verl_row`) for the
  ``chain_sum`` problems (:mod:`.problems`); verl scores them with
  :func:`verl_group_ppo.tasks.tiny.reward.compute_score` (the task's exact verifier);
* ``DIR/data/prepare.json``: the settings the task was built with and what the warm start measured (the key file
  of every task, :mod:`verl_group_ppo.tasks.contract`).

A second call with the same settings finds ``prepare.json`` and does nothing.

``--variant tools`` (or ``--tools``) builds the tool task instead (:mod:`.tooluse`, docs/multiturn.md): a tokenizer
with the tool-call markers and a ``tool`` role in its chat template, a warm start on tool episodes laid out as
verl's tool agent loop lays them out, rows for verl's ``tool_agent`` loop, and checks of the sampled accuracy and of
how often the warm-started model calls the tool. What differs between the variants is in :mod:`.variants`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Sequence

from .. import contract
from ..contract import setting
from .chat import ChatTokenizer, train_tokenizer
from .problems import Problem, Task, make_task, split_problems
from .reward import data_source_for
from .variants import TOOLS, VARIANTS, verl_row

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PrepareSettings:
    """Everything the outputs depend on (the cache key). The slip probability is 0.1 and the model the ``small``
    one (hidden 128, ~0.56M parameters), so that 40 verl steps on 2 cores show the reward rise (docs/cpu.md, "The
    tiny task"); the ``tiny`` size's warm start leaves RL less to fix in 40 steps."""

    task: str = setting("chain_sum", "the problems: chain_sum or mod_chain (tasks/tiny/problems.py)")
    model_size: str = setting("small", "the model size (tiny, small, ...; tasks/tiny/model.py)")
    warmstart_steps: int = setting(2000, "supervised warm-start steps")
    warmstart_batch_size: int = setting(64, "problems per warm-start step")
    warmstart_lr: float = setting(2e-3, "the warm start's learning rate")
    warmstart_slip_prob: float = setting(0.1, "the warm start's worked solutions slip a step with this probability")
    seed: int = setting(0, "seed of the problem split and the warm start")
    n_train: int = setting(20000, "training problems")
    n_test: int = setting(256, "test problems (verl's validation set)")
    response_length: int = setting(24, "reply length in tokens of the warm start and the checks (the launcher's)")
    tokenizer_vocab_size: int = setting(320, "the byte-level BPE's vocabulary size")
    min_sampled_accuracy: float = setting(0.02, "refuse a warm start that samples fewer correct (0: no check)")
    variant: str = setting("single_turn", "the task variant: single_turn, or tools (calls of a calculator)")
    tool_prob: float = setting(0.5, "tools: each step of a warm-start episode calls the tool with this probability")
    max_assistant_turns: int = setting(6, "tools: the agent loop's turn limit (the checks' sampler uses it too)")
    min_call_rate: float = setting(0.5, "tools: refuse a warm start whose sampled responses call the tool less often")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"{f.name}: must be >= 0, got {value}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: unknown task variant {self.variant!r}; choose one of {sorted(VARIANTS)}")
        data_source_for(self.task, VARIANTS[self.variant].data_source_suffix)  # ValueError for a task it lacks
        for name in ("tool_prob", "min_call_rate"):
            if getattr(self, name) > 1:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.warmstart_batch_size > self.n_train:
            raise ValueError(f"warmstart_batch_size: {self.warmstart_batch_size} exceeds n_train={self.n_train}")


def task_and_split(settings: PrepareSettings) -> tuple[Task, list[Problem], list[Problem]]:
    """The task and its (train, test) problems exactly as ``prepare`` draws them for ``settings``."""
    task = make_task(settings.task)
    train, test = split_problems(task, settings.n_train, settings.n_test, seed=1234 + settings.seed)
    return task, train, test


def prepare(output_dir: str, settings: PrepareSettings = PrepareSettings(), log: Callable[[str], None] = print,
            force: bool = False) -> dict:
    """Write ``output_dir/model`` and ``output_dir/data/{train,test}.parquet``; returns the key-file contents.

    Skips all work when the outputs exist and were built with the same settings (unless ``force``).
    """
    if not force and contract.is_prepared(output_dir, settings, FORMAT_VERSION):
        log(f"[prepare] {output_dir} already holds the model and data for these settings; nothing to do")
        return contract.read_key(output_dir)
    from .warmstart import save_model, warm_start

    t0, variant = time.time(), VARIANTS[settings.variant]
    task, train, test = task_and_split(settings)
    log(f"[prepare] {len(train)} train / {len(test)} test {task.name} problems ({time.time() - t0:.0f} s)")
    hf, vocab, merges = train_tokenizer(variant.tokenizer_texts(train, settings), settings.tokenizer_vocab_size,
                                        variant.chat_template, variant.added_tokens)
    tok = ChatTokenizer(hf)
    log(f"[prepare] byte-level BPE tokenizer: {tok.vocab_size} tokens; warm start of a {settings.model_size} "
        f"Qwen2 model for {settings.warmstart_steps} steps ({variant.name} task)")
    make_batch = variant.batch_maker(settings, tok) if variant.batch_maker is not None else None
    policy, final_loss = warm_start(settings, task, tok, train, log, make_batch)
    accuracy = variant.evaluate(policy, task, tok, test, settings)
    log("[prepare] warm-started accuracy on the test set: " + ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items()))
    variant.check(accuracy, settings)
    info = {"format_version": FORMAT_VERSION, "settings": asdict(settings), "final_loss": final_loss,
            "test_accuracy": accuracy, "seconds": round(time.time() - t0, 1),
            "num_parameters": sum(p.numel() for p in policy.parameters())}
    rows = {split: [verl_row(p, task, split, i, variant) for i, p in enumerate(problems)]
            for split, problems in (("train", train), ("test", test))}
    contract.write_task(output_dir, rows, info, lambda path: save_model(policy, tok, vocab, merges, path))
    log(f"[prepare] wrote {output_dir}/model and {output_dir}/data/{{train,test}}.parquet ({info['seconds']} s)")
    return info


# ------------------------------------------------------------------------------------------ command line

def build_parser() -> argparse.ArgumentParser:
    """The command line: :func:`verl_group_ppo.tasks.contract.settings_parser` of :class:`PrepareSettings`, and
    ``--tools``."""
    p = contract.settings_parser(PrepareSettings, "python -m verl_group_ppo.tasks.tiny.prepare",
                                 __doc__.split("\n\n")[0], VARIANTS)
    p.add_argument("--tools", dest="variant", action="store_const", const=TOOLS.name,
                   help=f"the tool task: short for --variant {TOOLS.name}")
    return p


def settings_from_flags(flags: dict[str, Any]) -> PrepareSettings:
    """The settings from the parsed flags: a flag not given (None) takes its default, the variant's own
    (:data:`.variants.VARIANTS`) where it has one."""
    return contract.settings_from_flags(PrepareSettings, VARIANTS, flags)


def main(argv: Sequence[str] | None = None) -> int:
    return contract.run_prepare_command(build_parser(), settings_from_flags, prepare, argv)


if __name__ == "__main__":
    raise SystemExit(main())
