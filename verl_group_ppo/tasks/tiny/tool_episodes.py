"""Tool-use episodes as token sequences, laid out exactly as verl's tool agent loop lays them out.

verl's ``ToolAgentLoop`` builds a multi-turn response with its Continuous Token builder: the chat-templated
prompt, then each assistant turn's generated tokens (``response_mask`` 1, EOS ``<|im_end|>`` included), then
the tokens the builder adds for the tool's reply (``response_mask`` 0: the newline after ``<|im_end|>``, the
templated tool message and the next ``<|im_start|>assistant\\n``). :class:`EpisodeEncoder` uses that very
builder, so the warm start trains on, and :func:`sample_episodes` samples, the token layout the RL run sees.

* :class:`EpisodeEncoder`: prompt, assistant-turn and tool-reply ids; a scripted episode as one training row;
* :func:`episode_batch`: a teacher-forced batch of scripted episodes with its loss mask (assistant tokens);
* :func:`sample_episodes`: the agent loop on the tiny model without verl's servers (for ``prepare``'s checks):
  sample a turn, run the calculator on its call, append the reply, until a turn makes no call.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .model import Rollout, left_pad, sample
from .problems import ChainSumTask, Problem
from .tooluse import Episode, add, parse_calls, score_transcript, scripted_episode


class EpisodeEncoder:
    """Token ids of episodes for a chat tokenizer (``prepare``'s, with the tool-call markers), through verl's
    Continuous Token builder for Qwen2 models."""

    def __init__(self, hf_tokenizer: Any):
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        self.hf = hf_tokenizer
        self.eos_id = int(hf_tokenizer.eos_token_id)
        self.pad_id = int(hf_tokenizer.pad_token_id)
        self.builder = create_continuous_token_builder(hf_tokenizer, hf_model_type="qwen2")
        self._prompts: dict[str, list[int]] = {}
        self._replies: dict[str, list[int]] = {}

    def prompt_ids(self, prompt: str) -> list[int]:
        """The chat-templated prompt with the generation prompt, as the agent loop's first request."""
        if prompt not in self._prompts:
            self._prompts[prompt] = list(self.builder.build_initial_tokens([{"role": "user", "content": prompt}]))
        return list(self._prompts[prompt])

    def turn_ids(self, text: str) -> list[int]:
        """An assistant turn's tokens as generated: its text, then EOS."""
        return list(self.hf.encode(text, add_special_tokens=False)) + [self.eos_id]

    def reply_ids(self, reply: str) -> list[int]:
        """The tokens the agent loop appends (with ``response_mask`` 0) after a turn that ended with EOS and
        called the tool, for the tool's reply text ``reply``."""
        if reply not in self._replies:
            previous = [{"role": "user", "content": "?"}, {"role": "assistant", "content": ""}]
            merged = self.builder.merge_context_tokens(previous, previous + [{"role": "tool", "content": reply}],
                                                       [self.eos_id])
            self._replies[reply] = list(merged.token_ids[1:])
        return list(self._replies[reply])

    def episode_ids(self, episode: Episode) -> tuple[list[int], list[int]]:
        """A scripted episode's response ids and its ``response_mask`` (1 on assistant tokens, 0 on replies)."""
        ids: list[int] = []
        mask: list[int] = []
        for k, text in enumerate(episode.turns):
            turn = self.turn_ids(text)
            ids += turn
            mask += [1] * len(turn)
            if k < len(episode.replies):
                reply = self.reply_ids(episode.replies[k])
                ids += reply
                mask += [0] * len(reply)
        return ids, mask


def episode_batch(encoder: EpisodeEncoder, problems: Sequence[Problem], rng: random.Random, tool_prob: float,
                  slip_prob: float, response_len: int, device: Any) -> tuple[Rollout, torch.Tensor]:
    """A teacher-forced batch of scripted episodes (cut to ``response_len`` tokens): the rollout (its
    ``response_mask`` is the attention over real tokens) and the loss mask (B, T): 1 on assistant tokens."""
    prompt_ids, prompt_mask = left_pad([encoder.prompt_ids(p.prompt) for p in problems], encoder.pad_id, device)
    rows = [encoder.episode_ids(scripted_episode(p, rng, tool_prob, slip_prob)) for p in problems]
    width = min(response_len, max(len(ids) for ids, _ in rows))
    responses = torch.full((len(rows), width), encoder.pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width))
    loss_mask = torch.zeros((len(rows), width))
    for i, (ids, mask) in enumerate(rows):
        n = min(width, len(ids))
        responses[i, :n] = torch.tensor(ids[:n])
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(mask[:n], dtype=torch.float32)
    return Rollout(prompt_ids, prompt_mask, responses.to(device), attention.to(device)), loss_mask.to(device)


@dataclass
class SampledEpisode:
    """One sampled episode: its response ids and mask as the agent loop would return them, the decoded text
    (special tokens skipped, as verl's reward path decodes it), the reward and the number of tool calls."""

    response_ids: list[int]
    response_mask: list[int]
    text: str
    reward: float
    num_calls: int


@torch.no_grad()
def sample_episodes(policy: Any, encoder: EpisodeEncoder, task: ChainSumTask, problems: Sequence[Problem],
                    response_len: int, max_assistant_turns: int, generator: torch.Generator | None = None,
                    greedy: bool = False) -> list[SampledEpisode]:
    """Run the tool loop: sample each open episode's next turn (all open episodes as one batch), execute its
    first call with the calculator and append the reply, until a turn calls nothing, the episode reaches
    ``max_assistant_turns`` turns, or its response reaches ``response_len`` tokens (a reply that would reach
    it is not appended, as in verl's loop). ``num_calls`` counts the replies appended."""
    ids: list[list[int]] = [[] for _ in problems]
    masks: list[list[int]] = [[] for _ in problems]
    calls = [0] * len(problems)
    open_rows = [i for i in range(len(problems))]
    for turn_index in range(max_assistant_turns):
        if not open_rows:
            break
        prompts = [encoder.prompt_ids(problems[i].prompt) + ids[i] for i in open_rows]
        budget = max(response_len - len(ids[i]) for i in open_rows)
        out = sample(policy, prompts, budget, encoder.pad_id, encoder.eos_id, generator=generator, greedy=greedy)
        still_open = []
        for row, i in enumerate(open_rows):
            n = min(int(out.response_mask[row].sum()), response_len - len(ids[i]))
            turn = out.responses[row, :n].tolist()
            ids[i] += turn
            masks[i] += [1] * len(turn)
            if len(ids[i]) >= response_len or turn_index == max_assistant_turns - 1:
                continue
            _, found = parse_calls(encoder.hf.decode(turn, skip_special_tokens=True))
            if not found or turn[-1:] != [encoder.eos_id]:
                continue
            reply = encoder.reply_ids(str(add(*found[0])))
            if len(ids[i]) + len(reply) >= response_len:
                continue
            ids[i] += reply
            masks[i] += [0] * len(reply)
            calls[i] += 1
            still_open.append(i)
        open_rows = still_open
    episodes = []
    for i, problem in enumerate(problems):
        text = encoder.hf.decode(ids[i], skip_special_tokens=True)
        episodes.append(SampledEpisode(ids[i], masks[i], text, score_transcript(text, problem, task), calls[i]))
    return episodes
