"""``value_source: mc`` on verl: continuations from each group boundary, sampled by the run's own rollout servers
and scored by the run's own reward function.

The advantage step (driver) hands this module the batch's prompts, replies and group starts. For every group start
after position 0 it asks for ``mc_samples`` (K) continuations of ``prompt + reply[:start]``, all at once: every
request goes to verl's ``LLMServerClient.generate`` concurrently, so the servers batch them (the ``hf`` server
gathers waiting requests into one left-padded batch, vLLM schedules them together). A continuation may use the
reply's remaining budget (``response_length - start`` tokens) and samples with the rollout's temperature, top-p and
top-k. Each ``reply[:start] + continuation`` is decoded as verl's reward loop decodes a reply
(``skip_special_tokens=True``) and scored with the run's reward function (``reward.custom_reward_function``, else
verl's ``default_compute_score``), with the row's ``data_source``, ``reward_model.ground_truth`` and ``extra_info``.

The math (what the scores become) is :func:`verl_group_ppo.value_sources.mc_boundary_values`.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence
from uuid import uuid4

import torch

from verl_group_ppo.config import select


@dataclass(frozen=True)
class Prefix:
    """One boundary to continue from: the prompt's token ids, the reply's tokens before the boundary, and the
    tokens the reply had left there."""

    prompt_ids: list[int]
    reply_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class RowInfo:
    """What the reward function reads about a row besides the reply."""

    data_source: str
    ground_truth: Any
    extra_info: dict


def boundary_prefixes(prompts: Sequence[Sequence[int]], responses: torch.Tensor, starts: torch.Tensor,
                      response_length: int) -> tuple[list[Prefix], list[int]]:
    """The prefixes to continue, in ``nonzero(starts[:, 1:])`` order (row by row, left to right), and each one's row.

    Args:
        prompts: B lists of prompt token ids (no padding).
        responses: (B, T) response token ids.
        starts: (B, T) bool, each group's first valid position (position 0 is never continued: its value is the
            prompt's mean reward, see :func:`~verl_group_ppo.value_sources.mc_boundary_values`).
        response_length: the rollout's ``response_length`` (a reply's token budget).
    """
    later = starts.clone()
    later[:, 0] = False
    prefixes, rows = [], []
    for row, start in later.nonzero().tolist():
        prefixes.append(Prefix(prompt_ids=[int(t) for t in prompts[row]],
                               reply_ids=responses[row, :start].tolist(), max_tokens=max(1, response_length - start)))
        rows.append(row)
    return prefixes, rows


def rollout_sampling_params(config: Any) -> dict[str, Any]:
    """The sampling parameters verl's agent loop uses for training rollouts (no log-probs: none are read)."""
    rollout = "actor_rollout_ref.rollout"
    return {"temperature": float(select(config, f"{rollout}.temperature", 1.0)),
            "top_p": float(select(config, f"{rollout}.top_p", 1.0)),
            "top_k": int(select(config, f"{rollout}.top_k", -1)),
            "repetition_penalty": 1.0, "logprobs": False}


async def sample_continuations(client: Any, prefixes: Sequence[Prefix], k: int,
                               sampling_params: dict[str, Any]) -> list[list[list[int]]]:
    """K continuations per prefix through verl's ``LLMServerClient.generate``, all requests in flight at once.

    Returns, per prefix, K lists of generated token ids. RuntimeError when a server aborted a request.
    """

    async def one(prefix: Prefix) -> list[int]:
        output = await client.generate(uuid4().hex, prompt_ids=prefix.prompt_ids + prefix.reply_ids,
                                       sampling_params={**sampling_params, "max_tokens": prefix.max_tokens})
        if getattr(output, "stop_reason", None) == "aborted":
            raise RuntimeError("value_source=mc: a rollout server aborted a continuation request (were the "
                               "replicas asleep or updating weights?)")
        return list(output.token_ids)

    flat = await asyncio.gather(*[one(prefix) for prefix in prefixes for _ in range(k)])
    return [flat[i * k:(i + 1) * k] for i in range(len(prefixes))]


def reward_function(config: Any) -> Callable[..., Any]:
    """The run's rule reward: ``reward.custom_reward_function`` (verl's loader), else verl's
    ``default_compute_score``."""
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.reward_score import default_compute_score

    return get_custom_reward_fn(config) or default_compute_score


def score_continuations(score_fn: Callable[..., Any], tokenizer: Any, prefixes: Sequence[Prefix],
                        continuations: Sequence[Sequence[Sequence[int]]], rows: Sequence[int],
                        info: Sequence[RowInfo]) -> torch.Tensor:
    """(S, K) float32: the reward of each ``reply[:start] + continuation``, as verl's naive reward manager scores a
    reply (a dict result's ``score``)."""
    scores = torch.empty((len(prefixes), len(continuations[0]) if continuations else 0), dtype=torch.float32)
    for s, (prefix, samples, row) in enumerate(zip(prefixes, continuations, rows)):
        for j, tokens in enumerate(samples):
            text = tokenizer.decode(prefix.reply_ids + list(tokens), skip_special_tokens=True)
            result = score_fn(data_source=info[row].data_source, solution_str=text,
                              ground_truth=info[row].ground_truth, extra_info=dict(info[row].extra_info))
            if inspect.iscoroutine(result):
                result = asyncio.run(result)
            scores[s, j] = float(result["score"] if isinstance(result, dict) else result)
    return scores


def row_info(data_source: Sequence[Any], reward_model: Sequence[Any],
             extra_info: Optional[Sequence[Any]]) -> list[RowInfo]:
    """The rows' reward inputs from verl's non-tensor fields (``extra_info`` may be absent)."""
    extras = list(extra_info) if extra_info is not None else [{}] * len(data_source)
    return [RowInfo(data_source=str(source), ground_truth=(model or {}).get("ground_truth"),
                    extra_info=dict(extra or {}))
            for source, model, extra in zip(data_source, reward_model, extras)]
