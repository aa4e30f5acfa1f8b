"""From a ``generate`` call to a :class:`~verl_group_ppo.rollout.generation.SamplingRequest`: its token budget and
the sampling parameters the ``hf`` rollout applies (temperature, top-p, top-k, a token budget).

The agent loop calls the server with a prompt's token ids and verl's sampling parameters; the rollout config
(``RolloutConfig`` or its DictConfig) gives the lengths the budget is computed from, as verl's vLLM server does.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

from verl_group_ppo.rollout.generation import SamplingRequest

logger = logging.getLogger("verl_group_ppo.rollout")


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` for a dataclass, DictConfig or mapping; ``default`` when absent or None."""
    getter = getattr(config, "get", None)
    value = getter(key, None) if getter is not None and not hasattr(config, "__dataclass_fields__") \
        else getattr(config, key, None)
    return default if value is None else value


def resolve_max_tokens(sampling_params: dict[str, Any], prompt_len: int, prompt_length: int, response_length: int,
                       max_model_len: Optional[int]) -> int:
    """The token budget of one request, as verl's vLLM server computes it.

    ``max_tokens`` (or ``max_new_tokens``) from the request if given, else
    ``min(response_length, prompt_length + response_length - prompt_len)``; then clamped to
    ``[1, max_model_len - prompt_len]``. Raises ``ValueError`` when the prompt leaves no room.
    """
    context = max_model_len or (prompt_length + response_length)
    room = context - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room to generate within the context of "
                         f"{context} tokens (actor_rollout_ref.rollout.max_model_len / prompt_length + "
                         f"response_length)")
    requested = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
    if requested is None:
        requested = min(response_length, prompt_length + response_length - prompt_len)
    return max(1, min(int(requested), room))


SUPPORTED_SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "max_tokens", "max_new_tokens",
                                     "repetition_penalty"})
_warned_keys: set[str] = set()


def check_sampling_params(sampling_params: dict[str, Any]) -> None:
    """Refuse a ``repetition_penalty`` other than 1 (``NotImplementedError``); log a WARNING, once per key,
    for keys the hf rollout does not apply (it samples with temperature, top-p, top-k and a token budget)."""
    penalty = sampling_params.get("repetition_penalty")
    if penalty is not None and float(penalty) != 1.0:
        raise NotImplementedError(f"the hf rollout has no repetition penalty (got repetition_penalty={penalty})")
    for key in sorted(set(sampling_params) - SUPPORTED_SAMPLING_KEYS - _warned_keys):
        _warned_keys.add(key)
        logger.warning("hf rollout: sampling parameter %r=%r is not applied", key, sampling_params[key])


def to_sampling_request(prompt_ids: Iterable[int], sampling_params: dict[str, Any], config: Any) -> SamplingRequest:
    """A :class:`SamplingRequest` from the agent loop's ``prompt_ids`` and ``sampling_params``
    (``temperature``, ``top_p``, ``top_k``, optional ``max_tokens``; see :func:`check_sampling_params`) and
    the rollout config's lengths."""
    check_sampling_params(sampling_params)
    prompt = tuple(int(token) for token in prompt_ids)
    max_tokens = resolve_max_tokens(sampling_params, len(prompt), int(config_value(config, "prompt_length", 512)),
                                    int(config_value(config, "response_length", 512)),
                                    config_value(config, "max_model_len"))
    return SamplingRequest(prompt_ids=prompt, max_tokens=max_tokens,
                           temperature=float(sampling_params.get("temperature", 1.0)),
                           top_p=float(sampling_params.get("top_p", 1.0)),
                           top_k=int(sampling_params.get("top_k", -1) or -1))

