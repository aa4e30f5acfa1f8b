"""Batched token-in/token-out sampling with a Hugging Face causal LM (the compute behind the ``hf`` rollout).

One call of :func:`generate_batch` runs a batch of prompts, left-padded as verl lays them out
(:func:`verl_group_ppo.critic_readout.left_pad`), through the model with a KV cache, one decoding step for
all rows at a time. Each row keeps its own sampling settings (temperature, top-p, top-k, token budget) and
stops at its own EOS. For every sampled token it returns the token id and
the log-probability of that token, as verl's rollout servers do (``TokenOutput.log_probs``).

Log-probabilities follow ``actor_rollout_ref.rollout.logprobs_mode``: ``processed_logprobs`` (verl's
default) is the log-probability under the distribution the token was sampled from (logits divided by the
temperature, then top-k/top-p filtered and renormalised); ``raw_logprobs`` is the log-softmax of the
model's logits. Greedy rows (temperature 0) report the raw log-probability of the argmax token.

The batch runs on the model's device, CPU or an accelerator, and a seeded sampler's ``torch.Generator`` must
live on that same device (:func:`check_generator_device`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from verl_group_ppo.critic_readout import left_pad, position_ids

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")

Device = Union[str, torch.device]
"""A torch device or its name (``"cpu"``, ``"cuda:0"``, ...)."""


@dataclass(frozen=True)
class SamplingRequest:
    """One prompt and how to sample its response.

    ``top_k <= 0`` means no top-k limit; ``temperature <= 0`` means greedy decoding.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@dataclass(frozen=True)
class Completion:
    """The sampled response of one request: token ids, their log-probs, whether it ended at EOS, and
    whether it was cut short by an abort (its tokens so far are kept)."""

    token_ids: list[int]
    log_probs: list[float]
    stopped_at_eos: bool
    aborted: bool = False


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits [B, V] outside each row's top-k / top-p nucleus to ``-inf``.

    ``top_k`` [B] (int, <= 0: no limit), ``top_p`` [B] (float in (0, 1]). The most likely token always
    survives. Returns a new tensor [B, V] (``logits`` itself when no row limits anything: the sort over a real
    vocabulary is the costliest part of a sampling step).
    """
    if bool(((top_k <= 0) | (top_k >= logits.shape[-1])).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1]))
    drop = rank >= k.unsqueeze(-1)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  generator: Optional[torch.Generator] = None,
                  logprobs_mode: str = "processed_logprobs") -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; returns (tokens [B] int64, log-probs [B] float32).

    ``temperature`` [B] float (<= 0: greedy), ``top_k`` [B] int, ``top_p`` [B] float. Log-probs follow
    ``logprobs_mode`` (see the module docstring).
    ``generator`` must live on the device of ``logits`` (``torch.multinomial`` takes a generator of the
    tensors' own device only); ``ValueError`` otherwise.
    """
    check_generator_device(generator, logits.device)
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"actor_rollout_ref.rollout.logprobs_mode={logprobs_mode!r}: the hf rollout supports "
                         f"{LOGPROBS_MODES}")
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1)
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    processed_logprobs = filter_top_k_top_p(scaled, top_k, top_p).log_softmax(dim=-1)
    sampled = torch.multinomial(processed_logprobs.exp(), 1, generator=generator).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    chosen = raw_logprobs if logprobs_mode == "raw_logprobs" else torch.where(
        greedy.unsqueeze(-1), raw_logprobs, processed_logprobs)
    return tokens, chosen.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def check_generator_device(generator: Optional[torch.Generator], device: Device) -> None:
    """Raise ``ValueError`` naming both devices when ``generator`` is not on ``device``'s kind of device
    (a seeded sampler for CUDA tensors needs ``torch.Generator(device="cuda")``)."""
    if generator is None:
        return
    wanted = torch.device(device)
    if generator.device.type != wanted.type:
        raise ValueError(f"generator is on {generator.device}, the tensors it samples are on {wanted}: create it "
                         f"with torch.Generator(device={wanted.type!r})")


def resolve_device(model: Any, device: Optional[Device]) -> torch.device:
    """The device a batch runs on: ``device`` if given, else that of the model's first parameter.

    Raises ``ValueError`` naming ``device`` when it is given and the model's parameters are elsewhere.
    """
    model_device = next(model.parameters()).device
    if device is None:
        return model_device
    wanted = torch.device(device)
    if wanted.type != model_device.type or (wanted.index is not None and wanted.index != model_device.index):
        raise ValueError(f"device={str(wanted)!r} but the model's parameters are on {model_device}: move the model "
                         f"there first (model.to(device))")
    return model_device


def _settings(requests: Sequence[SamplingRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [B] float, top_k [B] int64, top_p [B] float, max_tokens [B] int64)."""
    return (torch.tensor([r.temperature for r in requests], dtype=torch.float32),
            torch.tensor([r.top_k for r in requests], dtype=torch.long),
            torch.tensor([r.top_p for r in requests], dtype=torch.float32),
            torch.tensor([r.max_tokens for r in requests], dtype=torch.long))


@torch.no_grad()
def generate_batch(model: Any, requests: Sequence[SamplingRequest], eos_token_ids: Sequence[int], pad_token_id: int,
                   generator: Optional[torch.Generator] = None, logprobs_mode: str = "processed_logprobs",
                   should_abort: Optional[Callable[[], bool]] = None,
                   device: Optional[Device] = None) -> list[Completion]:
    """Generate the responses of ``requests`` as one left-padded batch through ``model`` (an HF causal LM).

    A row stops after emitting a token in ``eos_token_ids`` (the EOS token is part of its response) or
    after its ``max_tokens``; the loop ends when every row has stopped, or before any decoding step at which
    ``should_abort()`` is true (rows still running are then returned as ``aborted`` with their tokens so
    far). Returns one :class:`Completion` per request, in order.

    Every tensor of the batch lives on ``device`` (default: the model's device; the model must already be
    there), and ``generator`` must be a generator of that device (:func:`check_generator_device`).
    """
    if not requests:
        return []
    device = resolve_device(model, device)
    check_generator_device(generator, device)
    input_ids, attention_mask = left_pad([r.prompt_ids for r in requests], pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    temperature, top_k, top_p, budget = (t.to(device) for t in _settings(requests))
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
    positions = position_ids(attention_mask)
    # logits of the last position only: the prompt's other logits are never read ([B, L, V] for a real vocabulary
    # is the largest tensor of the whole generation)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    tokens, logprobs, done = [], [], torch.zeros(len(requests), dtype=torch.bool, device=device)
    ended_at_eos, aborted = done.clone(), done.clone()
    for step in range(int(budget.max())):
        if should_abort is not None and should_abort():
            aborted = ~done
            break
        next_tokens, next_logprobs = sample_tokens(out.logits[:, -1, :], temperature, top_k, top_p,
                                                   generator, logprobs_mode)
        next_tokens = next_tokens.masked_fill(done, pad_token_id)
        tokens.append(next_tokens)
        logprobs.append(next_logprobs)
        hit_eos = torch.isin(next_tokens, eos) & ~done
        ended_at_eos |= hit_eos
        done |= hit_eos | (budget <= step + 1)
        if bool(done.all()):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=next_tokens.unsqueeze(-1), attention_mask=attention_mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
    if not tokens:
        return [Completion([], [], stopped_at_eos=False, aborted=True) for _ in requests]
    return _collect(torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), eos, budget, ended_at_eos, aborted)


def _collect(tokens: torch.Tensor, logprobs: torch.Tensor, eos: torch.Tensor, budget: torch.Tensor,
             ended_at_eos: torch.Tensor, aborted: torch.Tensor) -> list[Completion]:
    """Cut each row of ``tokens``/``logprobs`` [B, T] after its first EOS or at its budget (an aborted row
    keeps the T tokens it has)."""
    completions = []
    for row in range(tokens.shape[0]):
        row_tokens = tokens[row]
        length = int(budget[row].clamp(max=tokens.shape[1]))
        if bool(ended_at_eos[row]):
            length = int(torch.isin(row_tokens, eos).nonzero()[0]) + 1
        completions.append(Completion(token_ids=row_tokens[:length].tolist(),
                                      log_probs=logprobs[row, :length].tolist(),
                                      stopped_at_eos=bool(ended_at_eos[row]), aborted=bool(aborted[row])))
    return completions
