"""The tiny task's variants: what ``prepare`` does differently for the single-turn task and for the tool task.

Each variant is one :class:`TinyVariant` (:data:`SINGLE_TURN`, :data:`TOOLS`, both in :data:`VARIANTS` under their
``name``); :func:`~.prepare.prepare` looks the settings' variant up once and the rest of its pipeline is shared. A
variant holds, beyond its ``name`` and ``defaults`` (:class:`~verl_group_ppo.tasks.contract.Variant`):

* ``chat_template`` and ``added_tokens``: the tokenizer's chat template and its tokens beyond ChatML's;
* ``data_source_suffix`` and ``row_columns``: what its verl rows carry beyond the common columns (:func:`verl_row`);
* ``tokenizer_texts(problems, settings)``: the texts its tokenizer is trained on;
* ``batch_maker(settings, tok)``: the warm start's batch maker (None: the task's worked solutions);
* ``evaluate(policy, task, tok, problems, settings)``: the accuracy dict that ``prepare.json`` records;
* ``check(accuracy, settings)``: a RuntimeError when the warm start leaves RL too little to learn from.

Another variant of the task is one more :class:`TinyVariant` in :data:`VARIANTS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from ..contract import Variant
from .chat import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE, ChatTokenizer, chat_messages
from .problems import Problem, Task
from .reward import TOOLS_SUFFIX, data_source_for
from .tooluse import CALL_CLOSE, CALL_OPEN, scripted_episode

#: ``make_batch(problems, rng) -> (rollout, loss_mask)`` of :func:`.warmstart.train_warmstart`
MakeBatch = Callable[[list[Problem], Any], tuple[Any, Any]]
#: the prepare settings (:class:`.prepare.PrepareSettings`); typed loosely here, where prepare is not imported
Settings = Any


# ------------------------------------------------------------------------------ the single-turn task's parts

def single_turn_texts(problems: Sequence[Problem], settings: Settings) -> list[str]:
    """The text between special tokens of each chat-templated example: roles, prompts, worked solutions."""
    return [t for p in problems for t in ("user\n" + p.prompt, "\n", "assistant\n" + p.solution)]


def sampled_accuracy(policy, task: Task, tok: ChatTokenizer, problems: list[Problem], settings: Settings) -> dict:
    """The task's evaluation (:func:`.evaluation.evaluate`): mean verifier reward of 2 samples per prompt
    (temperature 1), and greedy."""
    from .evaluation import evaluate

    length = settings.response_length
    return {"sampled": evaluate(policy, task, tok, problems, length, greedy=False, samples=2),
            "greedy": evaluate(policy, task, tok, problems, length, greedy=True)}


def check_sampled_accuracy(accuracy: dict, settings: Settings) -> None:
    """RuntimeError naming the flags to change when the warm start samples fewer correct answers than
    ``min_sampled_accuracy``: RL from it would see almost no reward."""
    if accuracy["sampled"] < settings.min_sampled_accuracy:
        raise RuntimeError(
            f"the warm start samples {accuracy['sampled']:.3f} correct answers (< --min-sampled-accuracy "
            f"{settings.min_sampled_accuracy}): RL from it would see almost no reward. Give it more room with "
            "--warmstart-steps (more), --warmstart-slip-prob (lower) or --model-size (larger).")


# ------------------------------------------------------------------------------------ the tool task's parts

def tool_texts(problems: Sequence[Problem], settings: Settings) -> list[str]:
    """The text between special tokens of a scripted tool episode per problem (each step calls the tool with
    probability ``settings.tool_prob``, no slips): the prompt, the assistant turns with the call markers
    blanked (they are tokens of their own) and the tool replies."""
    import random

    rng, texts = random.Random(0), []
    for p in problems:
        episode = scripted_episode(p, rng, tool_prob=settings.tool_prob, slip_prob=0.0)
        texts += ["user\n" + p.prompt, "\n"]
        texts += ["assistant\n" + t.replace(CALL_OPEN, " ").replace(CALL_CLOSE, " ") for t in episode.turns]
        texts += ["tool\n" + r for r in episode.replies]
    return texts


def tool_batch_maker(settings: Settings, tok: ChatTokenizer) -> MakeBatch:
    """Warm-start batches of scripted tool episodes (:func:`.tool_episodes.episode_batch`), laid out as verl's
    tool agent loop lays them out, with the settings' ``tool_prob``, slip probability and response length."""
    import torch

    from .tool_episodes import EpisodeEncoder, episode_batch

    encoder = EpisodeEncoder(tok.hf)

    def make_batch(problems: list[Problem], rng: Any):
        return episode_batch(encoder, problems, rng, settings.tool_prob, settings.warmstart_slip_prob,
                             settings.response_length, torch.device("cpu"))

    return make_batch


def tool_accuracy(policy, task: Task, tok: ChatTokenizer, problems: list[Problem], settings: Settings) -> dict:
    """The tool loop's checks: mean reward of 2 sampled episodes per prompt (temperature 1, fixed generator)
    and of greedy ones, the share of sampled episodes with at least one tool call, and calls per episode."""
    import torch

    from .tool_episodes import EpisodeEncoder, sample_episodes

    encoder = EpisodeEncoder(tok.hf)
    run = lambda items, **kw: sample_episodes(policy, encoder, task, items, settings.response_length,  # noqa: E731
                                              settings.max_assistant_turns, **kw)
    sampled = run([p for p in problems for _ in range(2)], generator=torch.Generator().manual_seed(0))
    greedy = run(problems, greedy=True)
    n = len(sampled)
    return {"sampled": sum(e.reward for e in sampled) / n, "greedy": sum(e.reward for e in greedy) / len(greedy),
            "call_rate": sum(e.num_calls > 0 for e in sampled) / n,
            "calls_per_response": sum(e.num_calls for e in sampled) / n}


def check_tool_warm_start(accuracy: dict, settings: Settings) -> None:
    """:func:`check_sampled_accuracy`, then a RuntimeError when the warm start calls the tool in fewer sampled
    responses than ``min_call_rate``."""
    check_sampled_accuracy(accuracy, settings)
    if accuracy["call_rate"] < settings.min_call_rate:
        raise RuntimeError(
            f"the warm start calls the tool in {accuracy['call_rate']:.2f} of its sampled responses (< "
            f"--min-call-rate {settings.min_call_rate}): raise --tool-prob or --warmstart-steps.")


# ------------------------------------------------------------------------------------------ the variants

@dataclass(frozen=True)
class TinyVariant(Variant):
    """What ``prepare`` does differently for one variant of the tiny task (the module docstring lists the members)."""

    chat_template: str
    added_tokens: tuple[str, ...]
    data_source_suffix: str
    row_columns: Mapping[str, Any]
    tokenizer_texts: Callable[[Sequence[Problem], Settings], list[str]]
    batch_maker: Callable[[Settings, ChatTokenizer], MakeBatch] | None
    evaluate: Callable[[Any, Task, ChatTokenizer, list[Problem], Settings], dict]
    check: Callable[[dict, Settings], None]


#: the chain task: one prompt, one response of running totals and ``#answer``
SINGLE_TURN = TinyVariant(
    name="single_turn", defaults=MappingProxyType({}), chat_template=CHAT_TEMPLATE, added_tokens=(),
    data_source_suffix="", row_columns=MappingProxyType({}), tokenizer_texts=single_turn_texts, batch_maker=None,
    evaluate=sampled_accuracy, check=check_sampled_accuracy)

#: the tool task (:mod:`.tooluse`). Its responses hold up to 4 calls with their masked replies (about 17 tokens
#: each) and the answer, about 4x the single-turn tokens, so the model is the ``tiny`` size; 800 warm-start steps
#: at slip 0.3 sampled about 0.19 correct with the tool called in about 0.9 of the responses (docs/multiturn.md).
#: The call markers are tokens of their own, not special: decoded text keeps them for the parser.
TOOLS = TinyVariant(
    name="tools", defaults=MappingProxyType({"response_length": 96, "model_size": "tiny", "warmstart_steps": 800,
                                             "warmstart_slip_prob": 0.3}),
    chat_template=TOOL_CHAT_TEMPLATE, added_tokens=(CALL_OPEN, CALL_CLOSE), data_source_suffix=TOOLS_SUFFIX,
    row_columns=MappingProxyType({"agent_name": "tool_agent"}), tokenizer_texts=tool_texts,
    batch_maker=tool_batch_maker, evaluate=tool_accuracy, check=check_tool_warm_start)

#: the variants by name (``PrepareSettings.variant``, ``--variant``)
VARIANTS: dict[str, TinyVariant] = {v.name: v for v in (SINGLE_TURN, TOOLS)}


def verl_row(problem: Problem, task: Task, split: str, index: int,
             variant: TinyVariant = SINGLE_TURN) -> dict[str, Any]:
    """One row in verl's RL dataset format; ``extra_info`` carries what the verifier needs
    (:func:`.reward.problem_from_row` reads it back). The variant adds its columns (the tool task's name verl's
    tool agent loop, ``agent_name``) and its data source."""
    return {
        **variant.row_columns,
        "data_source": data_source_for(task.name, variant.data_source_suffix),
        "prompt": chat_messages(problem.prompt),
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"split": split, "index": index, "prompt": problem.prompt, "solution": problem.solution,
                       "entry_json": json.dumps(problem.entry)},
    }
