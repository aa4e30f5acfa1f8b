"""Build the tiny real task for verl's ``main_ppo`` on CPU: a warm-started model and verl-format data.

    python -m verl_group_ppo.tinytask.prepare --output-dir DIR

writes

* ``DIR/model``: an HF Qwen2-architecture causal LM (the demo's ``small`` config) with a byte-level BPE
  tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer.json``; transformers loads it as ``Qwen2Tokenizer``)
  trained locally on the task's text, a ChatML chat template, EOS ``<|im_end|>`` and pad ``<|endoftext|>``.
  Its weights are the task's supervised warm start (:func:`verl_group_ppo.tinytask.warmstart.train_warmstart`)
  on chat-templated prompts: a noisy reasoner that solves some problems when sampled, so RL has room to rise;
* ``DIR/data/train.parquet``, ``DIR/data/test.parquet``: verl's row format (``data_source``, ``prompt`` as
  chat messages, ``ability``, ``reward_model.ground_truth``, ``extra_info``) for the demo's ``chain_sum``
  task; verl scores them with :func:`verl_group_ppo.tinytask.reward.compute_score` (the task's exact verifier);
* ``DIR/data/prepare.json``: the settings the task was built with and what the warm start measured (the key file
  of every task, :mod:`verl_group_ppo.taskdir`).

The task, the problem split and the warm start are the ones the demo trains on (:mod:`verl_group_ppo.tinytask`).
A second call with the same settings finds ``prepare.json`` and does nothing.

``--variant tools`` (or ``--tools``) builds the tool task instead (:mod:`verl_group_ppo.tinytask.tooluse`,
docs/multiturn.md): a tokenizer with the tool-call markers and a ``tool`` role in its chat template, a warm start
on tool episodes laid out as verl's tool agent loop lays them out, rows for verl's ``tool_agent`` loop, and checks
of the sampled accuracy and of how often the warm-started model calls the tool.

Task variants. Everything that differs between the two tasks lives in one :class:`TaskVariant` each
(:data:`SINGLE_TURN`, :data:`TOOLS`, both in :data:`VARIANTS` under their ``name``); :func:`prepare` looks the
settings' variant up once and the rest of the pipeline is shared. A variant holds

* ``name``: the value of ``PrepareSettings.variant`` (``--variant``) that picks it;
* ``defaults``: the settings whose defaults differ for it (the command line applies them);
* ``chat_template`` and ``added_tokens``: the tokenizer's chat template and its tokens beyond ChatML's;
* ``data_source_suffix`` and ``row_columns``: what its verl rows carry beyond the common columns;
* ``tokenizer_texts(problems, settings)``: the texts its tokenizer is trained on;
* ``batch_maker(settings, tok)``: the warm start's batch maker (None: the task's worked solutions);
* ``evaluate(policy, task, tok, problems, settings)``: the accuracy dict that ``prepare.json`` records;
* ``check(accuracy, settings)``: a RuntimeError when the warm start leaves RL too little to learn from.

Another variant of the task is one more :class:`TaskVariant` in :data:`VARIANTS`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from .. import taskdir
from ..taskdir import setting
from .reward import TOOLS_SUFFIX, data_source_for
from .tasks import Problem, Task, make_task, split_problems
from .tooluse import CALL_CLOSE, CALL_OPEN, call_jinja, scripted_episode

FORMAT_VERSION = 1
PAD_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
#: ChatML, the format of Qwen's instruct models: ``<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n``
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: the tool task's ChatML. A tool reply is a ``tool`` message; an assistant message's calls (verl keeps them apart
#: from its text) are written back in the ``tinycalc`` format (:func:`.tooluse.call_jinja`, from the format's one
#: definition); the tool schemas are not rendered (the warm start teaches the one tool), which keeps prompts short.
TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}{% set args = call['function']['arguments'] %}"
    + call_jinja() + "{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class PrepareSettings:
    """Everything the outputs depend on (the cache key). Warm-start batch and lr are the demo's. Two settings
    differ from the demo's defaults so that 40 verl steps on 2 cores show the reward rise: the slip
    probability is 0.1, not 0.25, and the model is the demo's ``small`` one (hidden 128, ~0.56M parameters),
    not ``tiny``, whose warm start leaves RL less to fix in 40 steps (docs/cpu.md, "The tiny task")."""

    task: str = setting("chain_sum", "the demo's task the problems come from")
    model_size: str = setting("small", "the demo's model size (tiny, small, ...)")
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


class ChatTokenizer:
    """The HF tokenizer behind the interface the demo's warm start and evaluation use (see CharTokenizer):
    prompts are encoded through the chat template, a response ends with EOS (``<|im_end|>``)."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self.pad_id = hf_tokenizer.pad_token_id
        self.eos_id = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)
        self._prompt_ids: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: str) -> list[int]:
        """Ids of the chat-templated prompt, exactly as verl's dataset builds them (cached: the warm start
        encodes the same training prompts many times, and rendering the template costs ~0.15 ms)."""
        if prompt not in self._prompt_ids:
            self._prompt_ids[prompt] = list(self.hf.apply_chat_template(
                chat_messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False))
        return list(self._prompt_ids[prompt])

    def decode(self, ids: Sequence[int], stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.hf.decode(ids, skip_special_tokens=True)

    def to_str(self) -> str:
        return self.hf.backend_tokenizer.to_str()


def chat_messages(prompt: str) -> list[dict[str, str]]:
    """The row's ``prompt`` column: one user message holding the task's prompt."""
    return [{"role": "user", "content": prompt}]


#: ``make_batch(problems, rng) -> (rollout, loss_mask)`` of :func:`.warmstart.train_warmstart`
MakeBatch = Callable[[list[Problem], Any], tuple[Any, Any]]


# ------------------------------------------------------------------------------ the single-turn task's parts

def single_turn_texts(problems: Sequence[Problem], settings: PrepareSettings) -> list[str]:
    """The text between special tokens of each chat-templated example: roles, prompts, worked solutions."""
    return [t for p in problems for t in ("user\n" + p.prompt, "\n", "assistant\n" + p.solution)]


def sampled_accuracy(policy, task: Task, tok: ChatTokenizer, problems: list[Problem],
                     settings: PrepareSettings) -> dict:
    """The demo's evaluation (:func:`.evaluation.evaluate`): mean verifier reward of 2 samples per prompt
    (temperature 1), and greedy."""
    from .evaluation import evaluate

    length = settings.response_length
    return {"sampled": evaluate(policy, task, tok, problems, length, greedy=False, samples=2),
            "greedy": evaluate(policy, task, tok, problems, length, greedy=True)}


def check_sampled_accuracy(accuracy: dict, settings: PrepareSettings) -> None:
    """RuntimeError naming the flags to change when the warm start samples fewer correct answers than
    ``min_sampled_accuracy``: RL from it would see almost no reward."""
    if accuracy["sampled"] < settings.min_sampled_accuracy:
        raise RuntimeError(
            f"the warm start samples {accuracy['sampled']:.3f} correct answers (< --min-sampled-accuracy "
            f"{settings.min_sampled_accuracy}): RL from it would see almost no reward. Give it more room with "
            "--warmstart-steps (more), --warmstart-slip-prob (lower) or --model-size (larger).")


# ------------------------------------------------------------------------------------ the tool task's parts

def tool_texts(problems: Sequence[Problem], settings: PrepareSettings) -> list[str]:
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


def tool_batch_maker(settings: PrepareSettings, tok: ChatTokenizer) -> MakeBatch:
    """Warm-start batches of scripted tool episodes (:func:`.tool_episodes.episode_batch`), laid out as verl's
    tool agent loop lays them out, with the settings' ``tool_prob``, slip probability and response length."""
    import torch

    from .tool_episodes import EpisodeEncoder, episode_batch

    encoder = EpisodeEncoder(tok.hf)

    def make_batch(problems: list[Problem], rng: Any):
        return episode_batch(encoder, problems, rng, settings.tool_prob, settings.warmstart_slip_prob,
                             settings.response_length, torch.device("cpu"))

    return make_batch


def tool_accuracy(policy, task: Task, tok: ChatTokenizer, problems: list[Problem], settings: PrepareSettings) -> dict:
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


def check_tool_warm_start(accuracy: dict, settings: PrepareSettings) -> None:
    """:func:`check_sampled_accuracy`, then a RuntimeError when the warm start calls the tool in fewer sampled
    responses than ``min_call_rate``."""
    check_sampled_accuracy(accuracy, settings)
    if accuracy["call_rate"] < settings.min_call_rate:
        raise RuntimeError(
            f"the warm start calls the tool in {accuracy['call_rate']:.2f} of its sampled responses (< "
            f"--min-call-rate {settings.min_call_rate}): raise --tool-prob or --warmstart-steps.")


# ------------------------------------------------------------------------------------------ the variants

@dataclass(frozen=True)
class TaskVariant:
    """What ``prepare`` does differently for one task variant (the module docstring lists the members)."""

    name: str
    defaults: Mapping[str, Any]
    chat_template: str
    added_tokens: tuple[str, ...]
    data_source_suffix: str
    row_columns: Mapping[str, Any]
    tokenizer_texts: Callable[[Sequence[Problem], PrepareSettings], list[str]]
    batch_maker: Callable[[PrepareSettings, ChatTokenizer], MakeBatch] | None
    evaluate: Callable[[Any, Task, ChatTokenizer, list[Problem], PrepareSettings], dict]
    check: Callable[[dict, PrepareSettings], None]


#: the chain task of the demo: one prompt, one response of running totals and ``#answer``
SINGLE_TURN = TaskVariant(
    name="single_turn", defaults=MappingProxyType({}), chat_template=CHAT_TEMPLATE, added_tokens=(),
    data_source_suffix="", row_columns=MappingProxyType({}), tokenizer_texts=single_turn_texts, batch_maker=None,
    evaluate=sampled_accuracy, check=check_sampled_accuracy)

#: the tool task (:mod:`.tooluse`). Its responses hold up to 4 calls with their masked replies (about 17 tokens
#: each) and the answer, about 4x the single-turn tokens, so the model is the demo's ``tiny`` one; 800 warm-start
#: steps at slip 0.3 sampled about 0.19 correct with the tool called in about 0.9 of the responses
#: (docs/multiturn.md). The call markers are tokens of their own, not special: decoded text keeps them for the
#: parser.
TOOLS = TaskVariant(
    name="tools", defaults=MappingProxyType({"response_length": 96, "model_size": "tiny", "warmstart_steps": 800,
                                             "warmstart_slip_prob": 0.3}),
    chat_template=TOOL_CHAT_TEMPLATE, added_tokens=(CALL_OPEN, CALL_CLOSE), data_source_suffix=TOOLS_SUFFIX,
    row_columns=MappingProxyType({"agent_name": "tool_agent"}), tokenizer_texts=tool_texts,
    batch_maker=tool_batch_maker, evaluate=tool_accuracy, check=check_tool_warm_start)

#: the variants by name (``PrepareSettings.variant``, ``--variant``)
VARIANTS: dict[str, TaskVariant] = {v.name: v for v in (SINGLE_TURN, TOOLS)}


# ---------------------------------------------------------------------------------------- the shared pipeline

def train_tokenizer(texts: Sequence[str], vocab_size: int, variant: TaskVariant = SINGLE_TURN):
    """A byte-level BPE trained on ``texts`` with Qwen2's normaliser and pre-tokeniser (so the tokenizer
    transformers rebuilds from ``vocab.json`` + ``merges.txt`` is this one), with the variant's added tokens
    and chat template. Returns (Qwen2Tokenizer, vocab, merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    hf = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=PAD_TOKEN,
                        extra_special_tokens=[IM_START])
    if variant.added_tokens:
        hf.add_tokens(list(variant.added_tokens))
    hf.chat_template = variant.chat_template
    return hf, vocab, merges


def save_tokenizer(hf_tokenizer: Any, vocab: dict[str, int], merges: Sequence[tuple[str, str]], path: str) -> None:
    """``save_pretrained`` plus ``vocab.json`` and ``merges.txt`` (the files a Qwen2Tokenizer is built from)."""
    hf_tokenizer.save_pretrained(path)
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


def verl_row(problem: Problem, task: Task, split: str, index: int,
             variant: TaskVariant = SINGLE_TURN) -> dict[str, Any]:
    """One row in verl's RL dataset format; ``extra_info`` carries what the verifier needs. The variant adds
    its columns (the tool task's name verl's tool agent loop, ``agent_name``) and its data source."""
    return {
        **variant.row_columns,
        "data_source": data_source_for(task.name, variant.data_source_suffix),
        "prompt": chat_messages(problem.prompt),
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"split": split, "index": index, "prompt": problem.prompt, "solution": problem.solution,
                       "entry_json": json.dumps(problem.entry)},
    }


class PrintProgress:
    """The progress object ``train_warmstart`` drives (``update``/``set_postfix``), printed every 10%."""

    def __init__(self, total: int, log: Callable[[str], None]):
        self.total, self.log, self.done, self.postfix, self.t0 = total, log, 0, "", time.time()

    def update(self, n: int) -> None:
        self.done += n
        if self.done == self.total or self.done % max(1, self.total // 10) == 0:
            self.log(f"[prepare] warm start step {self.done}/{self.total} {self.postfix} "
                     f"({time.time() - self.t0:.0f} s)")

    def set_postfix(self, **kwargs: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in kwargs.items())


def warm_start(settings: PrepareSettings, variant: TaskVariant, task: Task, tok: ChatTokenizer,
               train: list[Problem], log: Callable[[str], None]):
    """The supervised warm start on chat-templated prompts, on the variant's batches. Returns (policy, final
    loss)."""
    import torch

    from .warmstart import train_warmstart

    make_batch = variant.batch_maker(settings, tok) if variant.batch_maker is not None else None
    policy, losses = train_warmstart(
        task, tok, train, settings.model_size, settings.warmstart_steps, settings.warmstart_batch_size,
        settings.warmstart_lr, settings.seed, settings.response_length, torch.device("cpu"),
        PrintProgress(settings.warmstart_steps, log), slip_prob=settings.warmstart_slip_prob, make_batch=make_batch)
    return policy.eval(), (losses[-1] if losses else float("nan"))


def save_model(policy, tok: ChatTokenizer, vocab, merges, path: str) -> None:
    from transformers import GenerationConfig

    policy.save_pretrained(path)
    GenerationConfig(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id).save_pretrained(path)
    save_tokenizer(tok.hf, vocab, merges, path)


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
    if not force and taskdir.is_prepared(output_dir, settings, FORMAT_VERSION):
        log(f"[prepare] {output_dir} already holds the model and data for these settings; nothing to do")
        return taskdir.read_key(output_dir)
    t0, variant = time.time(), VARIANTS[settings.variant]
    task, train, test = task_and_split(settings)
    log(f"[prepare] {len(train)} train / {len(test)} test {task.name} problems ({time.time() - t0:.0f} s)")
    hf, vocab, merges = train_tokenizer(variant.tokenizer_texts(train, settings), settings.tokenizer_vocab_size,
                                        variant)
    tok = ChatTokenizer(hf)
    log(f"[prepare] byte-level BPE tokenizer: {tok.vocab_size} tokens; warm start of a {settings.model_size} "
        f"Qwen2 model for {settings.warmstart_steps} steps ({variant.name} task)")
    policy, final_loss = warm_start(settings, variant, task, tok, train, log)
    accuracy = variant.evaluate(policy, task, tok, test, settings)
    log("[prepare] warm-started accuracy on the test set: " + ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items()))
    variant.check(accuracy, settings)
    info = {"format_version": FORMAT_VERSION, "settings": asdict(settings), "final_loss": final_loss,
            "test_accuracy": accuracy, "seconds": round(time.time() - t0, 1),
            "num_parameters": sum(p.numel() for p in policy.parameters())}
    rows = {split: [verl_row(p, task, split, i, variant) for i, p in enumerate(problems)]
            for split, problems in (("train", train), ("test", test))}
    write_outputs(output_dir, policy, tok, vocab, merges, rows, info)
    log(f"[prepare] wrote {output_dir}/model and {output_dir}/data/{{train,test}}.parquet ({info['seconds']} s)")
    return info


def write_outputs(output_dir: str, policy, tok: ChatTokenizer, vocab, merges, rows: dict[str, list[dict]],
                  info: dict) -> None:
    """Write each split's ``rows``, the model and the key file ``info`` (:func:`verl_group_ppo.taskdir.write_task`)."""
    taskdir.write_task(output_dir, rows, info, lambda path: save_model(policy, tok, vocab, merges, path))


# ------------------------------------------------------------------------------------------ command line

def _default_help(name: str, default: Any) -> str:
    """A setting's help: its default, and the variants' own defaults where they differ."""
    own = [f"{v.defaults[name]} with --variant {v.name}" for v in VARIANTS.values() if name in v.defaults]
    return f"(default: {'; '.join([str(default)] + own)})"


def build_parser() -> argparse.ArgumentParser:
    """The command line: :func:`verl_group_ppo.taskdir.settings_parser` of :class:`PrepareSettings`, and ``--tools``."""
    p = taskdir.settings_parser(PrepareSettings, "python -m verl_group_ppo.tinytask.prepare", __doc__.split("\n\n")[0],
                                defaults_note=_default_help, choices={"variant": sorted(VARIANTS)})
    p.add_argument("--tools", dest="variant", action="store_const", const=TOOLS.name,
                   help=f"the tool task: short for --variant {TOOLS.name}")
    return p


def settings_from_flags(flags: dict[str, Any]) -> PrepareSettings:
    """The settings from the parsed flags: a flag not given (None) takes its default, the variant's own
    (``TaskVariant.defaults``) where it has one."""
    return taskdir.settings_from_flags(PrepareSettings, {name: v.defaults for name, v in VARIANTS.items()}, flags)


def main(argv: Sequence[str] | None = None) -> int:
    return taskdir.run_prepare_command(build_parser(), settings_from_flags, prepare, argv)


if __name__ == "__main__":
    raise SystemExit(main())
