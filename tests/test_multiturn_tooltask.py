"""The tiny tool task (``tasks.tiny.tooluse``), its verl side (function tool, ``tinycalc`` format) and its token
layout (``tasks.tiny.tool_episodes``, through verl's Continuous Token builder)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from verl_group_ppo.tasks.tiny import chat, variants
from verl_group_ppo.tasks.tiny import prepare as prep
from verl_group_ppo.tasks.tiny import tooluse
from verl_group_ppo.tasks.tiny.reward import TOOLS_SUFFIX, compute_score, data_source_for
from verl_group_ppo.tasks.tiny.problems import ChainSumTask, split_problems
from verl_group_ppo.tasks.tiny.tool_episodes import EpisodeEncoder, episode_batch, sample_episodes
from verl_group_ppo.tasks.tiny.tooluse import (
    CALL_CLOSE,
    CALL_OPEN,
    Episode,
    add,
    chain_steps,
    format_call,
    parse_calls,
    score_transcript,
    scripted_episode,
)


TOOL_SETTINGS = prep.PrepareSettings(variant="tools")


@pytest.fixture(scope="module")
def problems():
    task = ChainSumTask()
    train, test = split_problems(task, 300, 16)
    return task, train, test


@pytest.fixture(scope="module")
def tool_tokenizer(problems):
    _, train, _ = problems
    hf, _, _ = chat.train_tokenizer(variants.TOOLS.tokenizer_texts(train, TOOL_SETTINGS), 300, variants.TOOLS.chat_template,
                                    variants.TOOLS.added_tokens)
    return hf


def _total(problem) -> int:
    first, terms = chain_steps(problem)
    return first + sum(terms)


def test_multiturn_scripted_episode_calls_the_tool_exactly_where_asked(problems):
    task, train, _ = problems
    for problem in train[:50]:
        first, terms = chain_steps(problem)
        always = scripted_episode(problem, random.Random(0), tool_prob=1.0, slip_prob=1.0)
        assert always.num_calls == len(terms) and len(always.turns) == len(terms) + 1
        totals = [first + sum(terms[:k + 1]) for k in range(len(terms))]
        assert list(always.replies) == [str(t) for t in totals]  # the tool is exact, slips or not
        assert always.turns[0] == format_call(first, terms[0]) and always.turns[-1] == f"#{problem.answer}"
        never = scripted_episode(problem, random.Random(0), tool_prob=0.0, slip_prob=0.0)
        assert never == Episode((problem.solution,), ())  # no tool: the single-turn worked solution
        transcript = "".join(t + (f"\ntool\n{r}\nassistant\n" if k < len(always.replies) else "")
                             for k, (t, r) in enumerate(zip(always.turns, always.replies + ("",))))
        assert score_transcript(transcript, problem, task) == 1.0


def test_multiturn_slips_happen_only_on_steps_the_model_writes(problems):
    task, train, _ = problems
    rng = random.Random(3)
    for problem in train[:40]:
        first, terms = chain_steps(problem)
        slipped = scripted_episode(problem, rng, 0.0, 1.0).turns[-1]  # one turn, every step written and slipped
        written = [int(x) for x in slipped.replace("#", " ").split()][:-1]
        previous = [first] + written[:-1]
        assert all(w != p + t for w, p, t in zip(written, previous, terms))
        called = scripted_episode(problem, rng, 1.0, 1.0)  # every step a call: no slip anywhere
        assert called.turns[-1] == f"#{problem.answer}"
    with pytest.raises(ValueError, match="tool_prob"):
        scripted_episode(train[0], rng, 1.5, 0.0)
    with pytest.raises(ValueError, match="slip_prob"):
        scripted_episode(train[0], rng, 0.5, -0.1)


def test_multiturn_call_format_round_trips():
    for a, b in [(4, 7), (11, -3), (-8, 0), (-8, -12), (0, 5)]:
        text, calls = parse_calls("5 " + format_call(a, b))
        assert calls == [(a, b)] and text == "5 " and add(a, b) == a + b
    text, calls = parse_calls(f"{CALL_OPEN}4*7{CALL_CLOSE} 3")  # not <int>+<int>: not a call, text kept
    assert calls == [] and text == f"{CALL_OPEN}4*7{CALL_CLOSE} 3"


def test_multiturn_reward_scores_the_final_answer_of_the_transcript(problems):
    task, train, _ = problems
    problem = train[0]
    row = variants.verl_row(problem, task, "train", 0, variants.TOOLS)
    assert row["agent_name"] == "tool_agent" and row["data_source"] == data_source_for("chain_sum", TOOLS_SUFFIX)
    assert "agent_name" not in variants.verl_row(problem, task, "train", 0)
    good = f"{format_call(*(chain_steps(problem)[0], chain_steps(problem)[1][0]))}\ntool\n5\nassistant\n#{problem.answer}"
    args = (row["data_source"], good, problem.answer, row["extra_info"])
    assert compute_score(*args) == 1.0
    assert compute_score(row["data_source"], good + "1", problem.answer, row["extra_info"]) == 0.0
    assert compute_score(row["data_source"], "no answer", problem.answer, row["extra_info"]) == 0.0
    with pytest.raises(ValueError, match="task_name"):
        data_source_for("mod_chain", TOOLS_SUFFIX)
    with pytest.raises(ValueError, match="suffix"):
        data_source_for("chain_sum", "+calc")


def test_multiturn_tool_tokenizer_keeps_call_markers_whole(tool_tokenizer):
    ids = tool_tokenizer.encode(format_call(11, -3), add_special_tokens=False)
    tokens = tool_tokenizer.convert_ids_to_tokens(ids)
    assert tokens[0] == CALL_OPEN and tokens[-1] == CALL_CLOSE
    assert tool_tokenizer.decode(ids, skip_special_tokens=True) == format_call(11, -3)  # decoded text keeps them
    rendered = tool_tokenizer.apply_chat_template(
        [{"role": "user", "content": "4+7="},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "add", "arguments": {"a": 4, "b": -7}}}]},
         {"role": "tool", "content": "-3"}], tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>user\n4+7=<|im_end|>\n<|im_start|>assistant\n<tool_call>4-7</tool_call><|im_end|>\n"
                        "<|im_start|>tool\n-3<|im_end|>\n<|im_start|>assistant\n")


def test_multiturn_episode_layout_masks_the_tool_reply(tool_tokenizer, problems):
    _, train, _ = problems
    encoder = EpisodeEncoder(tool_tokenizer)
    episode = scripted_episode(train[1], random.Random(0), tool_prob=1.0, slip_prob=0.0)
    ids, mask = encoder.episode_ids(episode)
    tokens = tool_tokenizer.convert_ids_to_tokens(ids)
    assert len(ids) == len(mask)
    # every assistant turn ends with EOS (mask 1); the reply span starts right after it and ends with the
    # next turn's generation prompt, all mask 0
    reply = encoder.reply_ids(episode.replies[0])
    first_turn = encoder.turn_ids(episode.turns[0])
    assert ids[: len(first_turn)] == first_turn and first_turn[-1] == tool_tokenizer.eos_token_id
    assert ids[len(first_turn): len(first_turn) + len(reply)] == reply
    assert mask[: len(first_turn)] == [1] * len(first_turn) and mask[len(first_turn): len(first_turn) + len(reply)] == [0] * len(reply)
    assert tool_tokenizer.decode(reply) == f"\n<|im_start|>tool\n{episode.replies[0]}<|im_end|>\n<|im_start|>assistant\n"
    assert tokens[-1] == "<|im_end|>" and mask[-1] == 1
    assert sum(1 for a, b in zip(mask, mask[1:]) if a == 1 and b == 0) == episode.num_calls  # one hole per call


def test_multiturn_episode_batch_and_sampler_shapes(tool_tokenizer, problems):
    from verl_group_ppo.tasks.tiny.model import build_policy

    task, train, test = problems
    encoder = EpisodeEncoder(tool_tokenizer)
    batch, loss_mask = episode_batch(encoder, train[:6], random.Random(0), 0.5, 0.2, 40, torch.device("cpu"))
    assert batch.responses.shape == loss_mask.shape and batch.responses.shape[1] <= 40
    assert torch.all(loss_mask <= batch.response_mask)  # the loss only on attended assistant tokens
    assert bool((batch.response_mask - loss_mask).sum() > 0)  # replies are attended, not trained on
    policy = build_policy(len(tool_tokenizer), "tiny", 0, encoder.pad_id, encoder.eos_id)
    episodes = sample_episodes(policy, encoder, task, test[:4], 30, 3, generator=torch.Generator().manual_seed(0))
    for e in episodes:
        assert len(e.response_ids) == len(e.response_mask) <= 30
        assert e.reward in (0.0, 1.0) and e.num_calls <= 2


def test_multiturn_tinycalc_parser_and_function_tool_through_verls_loaders(tool_tokenizer, tmp_path):
    from verl.experimental.agent_loop.tool_parser import ToolParser
    from verl.tools.function_tool import load_function_tools_from_path

    import importlib.util

    path = importlib.util.find_spec("verl_group_ppo.tasks.tiny.calculator_tool").origin
    tools = load_function_tools_from_path(path)  # as verl's agent-loop worker loads function_tool_path
    assert [t.name for t in tools] == ["add"]
    schema = tools[0].tool_schema.model_dump()
    assert sorted(schema["function"]["parameters"]["properties"]) == ["a", "b"]
    assert asyncio.run(tools[0].call({"a": 11, "b": -3})) == "8"
    parser = ToolParser.get_tool_parser("tinycalc", tool_tokenizer)  # registered by loading the tool file
    ids = tool_tokenizer.encode("8 " + format_call(8, 8), add_special_tokens=False) + [tool_tokenizer.eos_token_id]
    content, calls = asyncio.run(parser.extract_tool_calls(ids))
    assert content == "8 " and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 8, "b": 8})]
    from verl_group_ppo.tasks.tiny import tool_parser

    tool_parser.register()  # again: no-op
    saved = ToolParser._registry["tinycalc"]
    try:
        ToolParser._registry["tinycalc"] = type("Other", (ToolParser,), {"extract_tool_calls": None})
        with pytest.raises(ValueError, match="tinycalc"):
            tool_parser.register()
    finally:
        ToolParser._registry["tinycalc"] = saved


def test_multiturn_prepare_flags_take_the_tool_defaults():
    for flags in (["--tools"], ["--variant", "tools"]):
        args = vars(prep.build_parser().parse_args(["--output-dir", "x", "--warmstart-steps", "10", *flags]))
        for key in ("output_dir", "force", "threads"):  # what main() takes out before the settings
            args.pop(key)
        settings = prep.settings_from_flags(args)
        assert settings.variant == "tools" and settings.warmstart_steps == 10
        defaults = {k: v for k, v in variants.TOOLS.defaults.items() if k != "warmstart_steps"}
        assert defaults and {k: getattr(settings, k) for k in defaults} == defaults
    assert prep.settings_from_flags({"variant": None, "response_length": None}) == prep.PrepareSettings()
    assert prep.settings_from_flags({"variant": "tools", "model_size": "small"}).model_size == "small"
    with pytest.raises(ValueError, match="variant"):
        prep.settings_from_flags({"variant": "chat"})
    with pytest.raises(ValueError, match="task_name"):  # the tool task is built on chain_sum only
        prep.PrepareSettings(variant="tools", task="mod_chain")
    with pytest.raises(ValueError, match="tool_prob"):
        prep.PrepareSettings(variant="tools", tool_prob=1.5)
    with pytest.raises(RuntimeError, match="min-call-rate"):
        variants.TOOLS.check({"sampled": 0.3, "call_rate": 0.2}, TOOL_SETTINGS)
    with pytest.raises(RuntimeError, match="min-sampled-accuracy"):
        variants.TOOLS.check({"sampled": 0.0, "call_rate": 0.9}, TOOL_SETTINGS)
    variants.SINGLE_TURN.check({"sampled": 0.3}, prep.PrepareSettings())  # no call rate to check
    assert set(variants.VARIANTS) == {"single_turn", "tools"}


def test_multiturn_tokenizer_texts_follow_the_settings_tool_prob(problems):
    _, train, _ = problems
    never = variants.TOOLS.tokenizer_texts(train[:30], prep.PrepareSettings(variant="tools", tool_prob=0.0))
    always = variants.TOOLS.tokenizer_texts(train[:30], prep.PrepareSettings(variant="tools", tool_prob=1.0))
    assert not [t for t in never if t.startswith("tool\n")]
    assert len([t for t in always if t.startswith("tool\n")]) == sum(len(chain_steps(p)[1]) for p in train[:30])
    assert not [t for t in always if CALL_OPEN in t or CALL_CLOSE in t]  # the markers are tokens of their own


@pytest.mark.parametrize("a,b", [(4, 7), (11, -3), (-8, 0), (-8, -12), (0, 5), (123, -45)])
def test_multiturn_tool_template_writes_calls_as_format_call_does(tool_tokenizer, a, b):
    """The chat template renders an assistant message's tool_calls to exactly format_call's text, which
    parse_calls reads back."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    rendered = tool_tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "8 ", "tool_calls": [call]}],
        tokenize=False)
    turn = rendered.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    assert turn == "8 " + format_call(a, b)
    assert parse_calls(turn) == ("8 ", [(a, b)])


def test_multiturn_call_format_has_one_definition(monkeypatch):
    """Another layout in CALL_LAYOUT changes format_call, the parser's pattern and the template's Jinja alike."""
    import jinja2

    monkeypatch.setattr(tooluse, "CALL_LAYOUT", "<calc>{abs_b} {op} {a}</calc>")
    monkeypatch.setattr(tooluse, "_CALL", tooluse._call_pattern())
    for a, b in [(11, -3), (4, 7)]:
        text = format_call(a, b)
        assert text == f"<calc>{abs(b)} {'-' if b < 0 else '+'} {a}</calc>"
        assert parse_calls("x" + text) == ("x", [(a, b)])
        jinja = jinja2.Template("{% set args = call %}" + tooluse.call_jinja())
        assert jinja.render(call={"a": a, "b": b}) == text
        assert jinja.render(call={"x": 1}) == ""  # other arguments: no call written
