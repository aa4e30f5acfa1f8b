"""The ``hf`` rollout's prefix cache: the keys and values of finished replies, reused by requests whose prompt
continues one (``actor_rollout_ref.rollout.enable_prefix_caching``, on by default, as for vLLM).

A tree rollout's branch asks for its prompt plus its parent's first ``q`` reply tokens; a ``prefix_ready`` sample's
next piece asks for its prompt plus its reply so far. All of such a prompt but its last token has already run
through the model, as the prompt and reply of a row that finished. :class:`PrefixCache` keeps each finished row's
keys and values (per layer, that row's own cache columns) and finds them again from a new request's prompt; the
request then joins the running batch by feeding its last prompt token in the next decoding step, with no prefill
(:class:`~verl_group_ppo.rollout.generation.RunningBatch`).

A hit needs a finished row whose tokens start with all of the new prompt but its last token, and whose own prompt
but its last token is a prefix of the new one (so a request with the same prompt as a finished one hits too).
The cache holds at most ``max_tokens`` tokens, the least recently used rows dropped first; its owner empties it
whenever the served weights change, since keys and values of old weights must not continue a reply sampled under
new ones.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""A row's cache: per layer, (keys, values), each [heads, tokens, head_dim]."""


@dataclass(frozen=True, eq=False)
class _Entry:
    """One finished row: the tokens its cache holds (its prompt, then its reply but the last token) and the cache."""

    tokens: tuple[int, ...]
    kv: KV


class PrefixCache:
    """The cache of finished rows (module docstring).

    Args:
        max_tokens: the most tokens held over all rows (>= 1); a row longer than this is not kept.

    Attributes:
        hits, misses: lookups that found a row and lookups that did not.
        reused_tokens: the prompt tokens the hits did not have to run through the model.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be at least 1")
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = self.misses = self.reused_tokens = 0
        self._by_key: dict[tuple[int, ...], list[_Entry]] = {}
        self._lengths: Counter[int] = Counter()  # how many rows are filed under a key of each length
        self._order: OrderedDict[int, tuple[tuple[int, ...], _Entry]] = OrderedDict()  # id -> (key, row), oldest first

    def __len__(self) -> int:
        return len(self._order)

    def add(self, prompt_ids: Sequence[int], tokens: Sequence[int], kv: KV) -> None:
        """Keep a finished row: ``prompt_ids`` its request's prompt, ``tokens`` what its cache holds (the prompt, then
        the reply but its last token), ``kv`` that cache (:data:`KV`, ``len(tokens)`` columns). Raises
        ``ValueError`` when the cache's length is not ``len(tokens)`` or ``tokens`` does not start with the prompt."""
        tokens, prompt = tuple(tokens), tuple(prompt_ids)
        if tokens[:len(prompt)] != prompt:
            raise ValueError("tokens must start with prompt_ids (a row's cache holds its prompt, then its reply)")
        if any(k.shape[-2] != len(tokens) or v.shape[-2] != len(tokens) for k, v in kv):
            raise ValueError(f"kv holds {[k.shape[-2] for k, _ in kv][:1]} columns per layer for {len(tokens)} tokens")
        if not prompt or len(tokens) > self.max_tokens:
            return
        key, entry = prompt[:-1], _Entry(tokens, kv)
        self._by_key.setdefault(key, []).append(entry)
        self._lengths[len(key)] += 1
        self._order[id(entry)] = (key, entry)
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self._drop(*self._order.popitem(last=False)[1])

    def lookup(self, prompt_ids: Sequence[int]) -> Optional[KV]:
        """The cache of ``prompt_ids[:-1]`` (each tensor [heads, len(prompt_ids) - 1, head_dim], views of a kept
        row's) when a kept row holds those tokens (module docstring); None otherwise, and for a one-token prompt."""
        need = len(prompt_ids) - 1
        target = tuple(prompt_ids[:need])
        for length in sorted((n for n in self._lengths if n <= need), reverse=True):
            for entry in self._by_key.get(target[:length], ()):
                if len(entry.tokens) >= need > 0 and entry.tokens[:need] == target:
                    self.hits += 1
                    self.reused_tokens += need
                    self._order.move_to_end(id(entry))
                    return [(k[:, :need], v[:, :need]) for k, v in entry.kv]
        self.misses += 1
        return None

    def clear(self) -> None:
        """Drop every row (the served weights changed)."""
        self._by_key.clear()
        self._lengths.clear()
        self._order.clear()
        self.tokens = 0

    def _drop(self, key: tuple[int, ...], entry: _Entry) -> None:
        rows = self._by_key[key]
        rows.remove(entry)
        if not rows:
            del self._by_key[key]
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
        self.tokens -= len(entry.tokens)
