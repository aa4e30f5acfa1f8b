"""``value_source: mc`` on verl: :class:`RolloutSampler` samples the continuations through the run's own rollout
servers and scores them with the run's own reward function (verl glue; the math is :mod:`verl_group_ppo.values.mc`).

For every group start after position 0 it asks for ``mc_samples`` (K) continuations of ``prompt + reply[:start]``,
all at once: every request goes to verl's ``LLMServerClient.generate`` concurrently, so the servers batch them (the
``hf`` server gathers waiting requests into one left-padded batch, vLLM schedules them together). A continuation may
use the reply's remaining budget (``response_length - start`` tokens) and samples with the rollout's temperature,
top-p and top-k. Each ``reply[:start] + continuation`` is decoded as verl's reward loop decodes a reply
(``skip_special_tokens=True``) and scored with the run's reward function (``reward.custom_reward_function``, else
verl's ``default_compute_score``), with the row's ``data_source``, ``reward_model.ground_truth`` and ``extra_info``
(:class:`RowInfo`, the prefix's ``reward_input``). The log's timers: ``group_mc`` (all of it), with
``group_mc_generate`` and ``group_mc_score``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence
from uuid import uuid4

import torch

from verl_group_ppo.config import select
from verl_group_ppo.values.mc import Continuations, Prefix

ROLLOUT = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class RowInfo:
    """What the reward function reads about a row besides the reply."""

    data_source: str
    ground_truth: Any
    extra_info: dict


@dataclass(frozen=True)
class Request:
    """One generate request: the token ids to continue (prompt and reply prefix) and the tokens it may add."""

    prompt_ids: list[int]
    max_tokens: int


@dataclass
class RolloutSampler:
    """The :class:`~verl_group_ppo.values.mc.ContinuationSampler` over a verl run's rollout.

    Attributes:
        config: the run's config (rollout sampling settings, ``response_length``, the reward function's keys).
        tokenizer: decodes a continued reply for the reward function.
        client: returns verl's ``LLMServerClient`` (the trainer's ``get_llm_client``).
        wake: wakes the rollout replicas with the weights that generated the batch (the sync trainer put them to
            sleep after sampling; the actor has not updated yet).
        sleep: puts them back to sleep after the continuations.
        timer: a context manager per timer name (the trainer's ``marked_timer`` into its step timings).
        score_fn: the reward function; None loads the run's on first use (:func:`reward_function`).
    """

    config: Any
    tokenizer: Any
    client: Callable[[], Any]
    wake: Callable[[], None]
    sleep: Callable[[], None]
    timer: Callable[[str], ContextManager[Any]] = lambda name: contextlib.nullcontext()
    score_fn: Optional[Callable[..., Any]] = None

    def __call__(self, prefixes: Sequence[Prefix], k: int) -> Continuations:
        """K continuations of each prefix, sampled in one batch and scored: (S, K) scores and the tokens taken."""
        with self.timer("group_mc"):
            requests = continuation_requests(prefixes, int(select(self.config, f"{ROLLOUT}.response_length")))
            with self.timer("group_mc_generate"):
                self.wake()
                try:
                    continuations = run_async(sample_continuations(self.client(), requests, k,
                                                                   rollout_sampling_params(self.config)))
                finally:
                    self.sleep()
            if self.score_fn is None:
                self.score_fn = reward_function(self.config)
            with self.timer("group_mc_score"):
                scores = score_continuations(self.score_fn, self.tokenizer, prefixes, continuations)
        return Continuations(scores=scores, tokens=sum(len(c) for samples in continuations for c in samples))


def continuation_requests(prefixes: Sequence[Prefix], response_length: int) -> list[Request]:
    """One request per prefix: ``prompt + reply[:start]``, with the reply's remaining budget (at least 1 token)."""
    return [Request(prompt_ids=list(p.prompt_ids) + list(p.reply_ids),
                    max_tokens=max(1, response_length - len(p.reply_ids))) for p in prefixes]


def rollout_sampling_params(config: Any) -> dict[str, Any]:
    """The sampling parameters verl's agent loop uses for training rollouts (no log-probs: none are read)."""
    return {"temperature": float(select(config, f"{ROLLOUT}.temperature", 1.0)),
            "top_p": float(select(config, f"{ROLLOUT}.top_p", 1.0)),
            "top_k": int(select(config, f"{ROLLOUT}.top_k", -1)),
            "repetition_penalty": 1.0, "logprobs": False}


async def sample_continuations(client: Any, requests: Sequence[Request], k: int,
                               sampling_params: dict[str, Any]) -> list[list[list[int]]]:
    """K continuations per request through verl's ``LLMServerClient.generate``, all requests in flight at once.

    Returns, per request, K lists of generated token ids. RuntimeError when a server aborted a request.
    """

    async def one(request: Request) -> list[int]:
        output = await client.generate(uuid4().hex, prompt_ids=request.prompt_ids,
                                       sampling_params={**sampling_params, "max_tokens": request.max_tokens})
        if getattr(output, "stop_reason", None) == "aborted":
            raise RuntimeError("value_source=mc: a rollout server aborted a continuation request (were the "
                               "replicas asleep or updating weights?)")
        return list(output.token_ids)

    flat = await asyncio.gather(*[one(request) for request in requests for _ in range(k)])
    return [flat[i * k:(i + 1) * k] for i in range(len(requests))]


def run_async(coroutine: Any) -> Any:
    """Await ``coroutine`` from the driver's synchronous step (verl's ``auto_await`` picks the event loop)."""
    from verl.utils.ray_utils import auto_await

    async def wait() -> Any:
        return await coroutine

    return auto_await(wait)()


def reward_function(config: Any) -> Callable[..., Any]:
    """The run's rule reward: ``reward.custom_reward_function`` (verl's loader), else verl's
    ``default_compute_score``."""
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.reward_score import default_compute_score

    return get_custom_reward_fn(config) or default_compute_score


def score_continuations(score_fn: Callable[..., Any], tokenizer: Any, prefixes: Sequence[Prefix],
                        continuations: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
    """(S, K) float32: the reward of each ``reply[:start] + continuation``, as verl's naive reward manager scores a
    reply (a dict result's ``score``), with each prefix's :class:`RowInfo` (``reward_input``)."""
    scores = torch.empty((len(prefixes), len(continuations[0]) if continuations else 0), dtype=torch.float32)
    for s, (prefix, samples) in enumerate(zip(prefixes, continuations)):
        info: RowInfo = prefix.reward_input
        for j, tokens in enumerate(samples):
            text = tokenizer.decode(prefix.reply_ids + list(tokens), skip_special_tokens=True)
            result = score_fn(data_source=info.data_source, solution_str=text, ground_truth=info.ground_truth,
                              extra_info=dict(info.extra_info))
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
