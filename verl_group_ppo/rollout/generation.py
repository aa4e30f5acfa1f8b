"""Batched token-in/token-out sampling with a Hugging Face causal LM (the compute behind the ``hf`` rollout).

A :class:`RunningBatch` holds prompts left-padded as verl lays them out
(:func:`verl_group_ppo.critic_readout.left_pad`) and runs them through the model with a KV cache, one decoding
step for all rows at a time; requests join it between steps (their prompts prefilled and merged into the cache) and
leave it as soon as they stop (continuous batching); with the server's prefix cache
(:mod:`~verl_group_ppo.rollout.prefix_cache`) a request that continues a finished reply joins without a prefill.
:func:`generate_batch` runs one list of requests to the end.
Each row keeps its own sampling settings (temperature, top-p, top-k, token budget) and stops at its own EOS. For
every sampled token it returns the token id and the log-probability of that token, as verl's rollout servers do
(``TokenOutput.log_probs``).

Log-probabilities follow ``actor_rollout_ref.rollout.logprobs_mode``: ``processed_logprobs`` (verl's
default) is the log-probability under the distribution the token was sampled from (logits divided by the
temperature, then top-k/top-p filtered and renormalised); ``raw_logprobs`` is the log-softmax of the
model's logits. Greedy rows (temperature 0) report the raw log-probability of the argmax token.

A batch runs on the model's device, CPU or an accelerator, and a seeded sampler's ``torch.Generator`` must
live on that same device (:func:`check_generator_device`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from verl_group_ppo.critic_readout import left_pad, position_ids
from verl_group_ppo.rollout.prefix_cache import KV, PrefixCache

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


def _settings(requests: Sequence[SamplingRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [B] float, top_k [B] int64, top_p [B] float)."""
    return (torch.tensor([r.temperature for r in requests], dtype=torch.float32),
            torch.tensor([r.top_k for r in requests], dtype=torch.long),
            torch.tensor([r.top_p for r in requests], dtype=torch.float32))


def generate_batch(model: Any, requests: Sequence[SamplingRequest], eos_token_ids: Sequence[int], pad_token_id: int,
                   generator: Optional[torch.Generator] = None, logprobs_mode: str = "processed_logprobs",
                   should_abort: Optional[Callable[[], bool]] = None,
                   device: Optional[Device] = None) -> list[Completion]:
    """Generate the responses of ``requests`` as one batch through ``model`` (an HF causal LM): a
    :class:`RunningBatch` that all of them join at once, stepped until every row has left it.

    A row stops after emitting a token in ``eos_token_ids`` (the EOS token is part of its response) or after its
    ``max_tokens``; the loop ends when every row has stopped, or before any decoding step at which
    ``should_abort()`` is true (rows still running are then returned as ``aborted`` with their tokens so far).
    Returns one :class:`Completion` per request, in order.

    Every tensor of the batch lives on ``device`` (default: the model's device; the model must already be
    there), and ``generator`` must be a generator of that device (:func:`check_generator_device`).
    """
    if not requests:
        return []
    running = RunningBatch(model, eos_token_ids, pad_token_id, generator, logprobs_mode, device)
    completions: dict[Any, Completion] = {}
    running.admit(list(enumerate(requests)))
    while len(running):
        completions.update(running.step(should_abort))
    return [completions[i] for i in range(len(requests))]


@dataclass
class _Row:
    """One request in a :class:`RunningBatch`: the caller's key for it and the tokens sampled so far."""

    key: Any
    request: SamplingRequest
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


@dataclass
class _Warm:
    """A request whose prompt but its last token is in the prefix cache: it enters the batch at the next decoding
    step with that cache, its last prompt token fed in the step's forward pass."""

    row: _Row
    kv: KV


class RunningBatch:
    """A left-padded batch with a KV cache that requests join and leave between decoding steps (continuous
    batching): :meth:`admit` prefills new prompts and merges them into the running rows, :meth:`step` samples one
    token for every row, hands back the rows that stopped, and runs the rest one position further.

    Each row keeps its own sampling settings (temperature, top-p, top-k, token budget) and stops at its own EOS.
    A row that stops leaves the batch at once, and the cache columns that no remaining row attends to are dropped.
    Rows join a batch that is already decoding only where the model's cache is the plain dynamic cache (one
    key/value tensor per layer, no sliding window): :meth:`accepts_joins` says whether it is; otherwise new rows
    wait until the batch is empty. Seeded sampling draws from ``generator`` for the rows present at each step, so
    which tokens a seed gives depends on which requests ran together, as on any batching server.

    With a ``prefix_cache`` (plain caches only): requests with the same prompt in one :meth:`admit` are prefilled
    once and their cache copied; a request whose prompt but its last token a finished row already ran
    (:class:`~verl_group_ppo.rollout.prefix_cache.PrefixCache`) skips the prefill and joins at the next
    :meth:`step`, its last prompt token fed in that step's forward pass; and every row that stops leaves its cache
    there.

    Args:
        model: an HF causal LM, already on ``device``.
        eos_token_ids: the tokens that end a reply (kept as its last token).
        pad_token_id: the token fed at padded positions (masked out).
        generator: the seeded sampler's generator, on ``device``'s kind (:func:`check_generator_device`).
        logprobs_mode: ``processed_logprobs`` or ``raw_logprobs`` (the module docstring).
        device: where every tensor lives; default the model's device.
        prefix_cache: the server's cache of finished rows, read at :meth:`admit` and written as rows stop; None: no
            reuse.
    """

    def __init__(self, model: Any, eos_token_ids: Sequence[int], pad_token_id: int,
                 generator: Optional[torch.Generator] = None, logprobs_mode: str = "processed_logprobs",
                 device: Optional[Device] = None, prefix_cache: Optional[PrefixCache] = None) -> None:
        self.model = model
        self.device = resolve_device(model, device)
        check_generator_device(generator, self.device)
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"actor_rollout_ref.rollout.logprobs_mode={logprobs_mode!r}: the hf rollout supports "
                             f"{LOGPROBS_MODES}")
        self.generator, self.logprobs_mode, self.pad_token_id = generator, logprobs_mode, pad_token_id
        self.eos_set = frozenset(int(t) for t in eos_token_ids)
        self.prefix_cache = prefix_cache
        self.rows: list[_Row] = []
        self._warm: list[_Warm] = []  # prefix-cache hits that enter at the next step
        self._mask: Optional[torch.Tensor] = None  # (B, L) long: 1 where a row attends to a cache column
        self._last_position: Optional[torch.Tensor] = None  # (B, 1) long: the position of each row's last input
        self._settings: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # temperature, top_k, top_p
        self._logits: Optional[torch.Tensor] = None  # (B, V): each row's next-token logits
        self._cache: Any = None  # the model's past_key_values over the L columns
        self._plain_cache = False  # whether the cache is plain dynamic layers (:func:`_mergeable`), set at prefill

    def __len__(self) -> int:
        return len(self.rows) + len(self._warm)

    def keys(self) -> list[Any]:
        """The keys of every request in the batch, those about to enter from the prefix cache included."""
        return [row.key for row in self._all_rows()]

    def _all_rows(self) -> list[_Row]:
        return self.rows + [warm.row for warm in self._warm]

    def accepts_joins(self) -> bool:
        """Whether :meth:`admit` may add rows now: the batch is empty, or its cache can be merged."""
        return not len(self) or self._plain_cache

    @torch.no_grad()
    def admit(self, keyed_requests: Sequence[tuple[Any, SamplingRequest]]) -> None:
        """Add ``keyed_requests`` ((key, request) pairs; the key comes back with the completion) to the running rows:
        prefilled as one left-padded batch, or, with a prefix cache, from the cache of a finished row at the next
        :meth:`step` (class docstring). Raises ``RuntimeError`` when rows are running and the cache cannot be merged
        (:meth:`accepts_joins`)."""
        if not keyed_requests:
            return
        if not self.accepts_joins():
            raise RuntimeError(f"the model's cache ({type(self._cache).__name__}) cannot take rows while others "
                               f"decode: admit new requests once the batch is empty")
        cold = []
        for key, request in keyed_requests:
            kv = self.prefix_cache.lookup(request.prompt_ids) if self.prefix_cache is not None else None
            if kv is None:
                cold.append((key, request))
            else:  # the cache holds rows of plain caches only, so more rows may join this batch meanwhile
                self._warm.append(_Warm(_Row(key, request), kv))
                self._plain_cache = True
        if cold:
            self._prefill(cold)

    def _prefill(self, keyed_requests: Sequence[tuple[Any, SamplingRequest]]) -> None:
        """Run the prompts of ``keyed_requests`` through the model (each distinct prompt once, with a prefix cache)
        and add them to the running rows with their next-token logits."""
        requests = [request for _, request in keyed_requests]
        prompts, order = [r.prompt_ids for r in requests], None
        if self.prefix_cache is not None:  # each distinct prompt once; order[i]: request i's row among them
            distinct: dict[tuple[int, ...], int] = {}
            order = [distinct.setdefault(prompt, len(distinct)) for prompt in prompts]
            prompts = list(distinct)
        input_ids, mask = left_pad([list(p) for p in prompts], self.pad_token_id)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = position_ids(mask)
        # logits of the last position only: the prompt's other logits are never read ([N, L, V] for a real vocabulary
        # is the largest tensor of the whole generation)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        cache, logits, positions = out.past_key_values, out.logits[:, -1, :], positions[:, -1:]
        if order is not None and len(prompts) < len(requests):  # copy each prompt's rows to the requests sharing it
            index = torch.tensor(order, device=self.device)
            cache.batch_select_indices(index)
            mask, positions, logits = mask[index], positions[index], logits[index]
        self._append([_Row(key, request) for key, request in keyed_requests], cache, mask, positions, logits)

    def _append(self, rows: list[_Row], cache: Any, mask: torch.Tensor, positions: torch.Tensor,
                logits: Optional[torch.Tensor]) -> None:
        """Add ``rows`` with their model cache (N rows), mask [N, L'] long, last positions [N, 1] and next-token
        logits [N, V] (None: the next forward pass gives them) to the running ones, both left-padded to one width."""
        settings = tuple(t.to(self.device) for t in _settings([row.request for row in rows]))
        if not self.rows:
            self.rows, self._mask, self._cache = rows, mask, cache
            self._plain_cache = _mergeable(self._cache)
            self._last_position, self._settings, self._logits = positions, settings, logits
            return
        width = max(self._mask.shape[1], mask.shape[1])
        self._cache = _merged_caches(self._cache, cache, width)
        self._mask = torch.cat([_pad_left(self._mask, width), _pad_left(mask, width)])
        self._last_position = torch.cat([self._last_position, positions])
        self._settings = tuple(torch.cat([old, new]) for old, new in zip(self._settings, settings))
        if logits is not None:
            self._logits = torch.cat([self._logits, logits])
        self.rows += rows

    @torch.no_grad()
    def step(self, should_abort: Optional[Callable[[], bool]] = None) -> list[tuple[Any, Completion]]:
        """Sample one token for every row; return (key, completion) for each row that stopped (at EOS or its
        budget), remove them, and run the others, with the prefix-cache hits that enter now, one position further.
        When ``should_abort()`` is true no token is sampled: every row returns ``aborted`` with the tokens it has,
        and the batch is left empty."""
        if not len(self):
            return []
        if should_abort is not None and should_abort():
            stopped = [(row.key, Completion(row.token_ids, row.log_probs, stopped_at_eos=False, aborted=True))
                       for row in self._all_rows()]
            self._clear()
            return stopped
        stopped, tokens = [], None
        if self.rows:
            temperature, top_k, top_p = self._settings
            tokens, logprobs = sample_tokens(self._logits, temperature, top_k, top_p, self.generator,
                                             self.logprobs_mode)
            keep, ended = [], []
            for index, (row, token, logprob) in enumerate(zip(self.rows, tokens.tolist(), logprobs.tolist())):
                row.token_ids.append(token)
                row.log_probs.append(logprob)
                at_eos = token in self.eos_set
                if at_eos or len(row.token_ids) >= row.request.max_tokens:
                    stopped.append((row.key, Completion(row.token_ids, row.log_probs, stopped_at_eos=at_eos)))
                    ended.append(index)
                else:
                    keep.append(index)
            if ended and self.prefix_cache is not None and self._plain_cache:
                self._remember(ended)
            if not keep:
                self._clear_running()
                tokens = None
            elif ended:
                tokens = tokens[self._select(keep)]
        if self._warm:
            tokens = self._enter_warm(tokens)
        if not self.rows:
            return stopped
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        self._last_position = self._last_position + 1
        out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=self._mask, position_ids=self._last_position,
                         past_key_values=self._cache, use_cache=True)
        self._cache, self._logits = out.past_key_values, out.logits[:, -1, :]
        return stopped

    def _remember(self, ended: list[int]) -> None:
        """Leave the cache of the rows at ``ended`` (which stopped at this step, their last token not yet fed) in the
        prefix cache. A row's columns are the last ones of the batch's (rows are left-padded)."""
        for index in ended:
            row = self.rows[index]
            tokens = row.request.prompt_ids + tuple(row.token_ids[:-1])
            held = int(self._mask[index].sum())
            if held != len(tokens):
                raise RuntimeError(f"hf rollout: a row's cache holds {held} columns for its {len(tokens)} tokens")
            kv = [(layer.keys[index, :, -held:].clone(), layer.values[index, :, -held:].clone())
                  for layer in self._cache.layers]
            self.prefix_cache.add(row.request.prompt_ids, tokens, kv)

    def _enter_warm(self, tokens: Optional[torch.Tensor]) -> torch.Tensor:
        """Add the prefix-cache hits to the rows (their cache, mask, positions and settings) and return the step's
        input tokens [B]: ``tokens`` for the running rows (None: none run), then each hit's last prompt token."""
        from transformers.cache_utils import DynamicCache

        warm, self._warm = self._warm, []
        held = [w.kv[0][0].shape[-2] for w in warm]
        width = max(held)
        cache = DynamicCache()
        for i in range(len(warm[0].kv)):
            cache.update(torch.stack([_pad_left(w.kv[i][0], width) for w in warm]),
                         torch.stack([_pad_left(w.kv[i][1], width) for w in warm]), i)
        mask = torch.stack([torch.cat([torch.zeros(width - n, dtype=torch.long), torch.ones(n, dtype=torch.long)])
                            for n in held]).to(self.device)
        positions = torch.tensor([[n - 1] for n in held], device=self.device)
        last = torch.tensor([w.row.request.prompt_ids[-1] for w in warm], device=self.device)
        self._append([w.row for w in warm], cache, mask, positions, logits=None)
        return last if tokens is None else torch.cat([tokens, last])

    def _select(self, keep: list[int]) -> torch.Tensor:
        """Keep the rows at ``keep`` (ascending) and drop the cache columns none of them attends to; returns ``keep``
        as an index on the batch's device, for the caller's own per-row tensors."""
        index = torch.tensor(keep, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self._mask, self._last_position = self._mask[index], self._last_position[index]
        self._logits = self._logits[index]
        self._settings = tuple(t[index] for t in self._settings)
        self._cache.batch_select_indices(index)
        unused = int(self._mask.any(dim=0).long().argmax())  # leading columns that are padding in every row
        if unused and self._plain_cache:
            self._mask = self._mask[:, unused:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[..., unused:, :], layer.values[..., unused:, :]
        return index

    def _clear(self) -> None:
        self._warm = []
        self._clear_running()

    def _clear_running(self) -> None:
        """Drop the running rows and their cache (prefix-cache hits waiting to enter stay)."""
        self.rows = []
        self._mask = self._last_position = self._settings = self._logits = self._cache = None


def _mergeable(cache: Any) -> bool:
    """Whether ``cache`` is a transformers dynamic cache of plain layers (one growing key/value tensor
    (B, heads, L, dim) each): rows can then be added and leading columns dropped by editing those tensors."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # a transformers whose caches hold per-layer lists: rows join only an empty batch
        return False
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def _pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` (N, ..., L, dim) or a mask (N, L) with zero columns prepended along its sequence axis to ``width``."""
    missing = width - (x.shape[1] if x.dim() == 2 else x.shape[-2])
    if missing == 0:
        return x
    pad = (missing, 0) if x.dim() == 2 else (0, 0, missing, 0)
    return torch.nn.functional.pad(x, pad)


def _merged_caches(running: Any, joining: Any, width: int) -> Any:
    """``running``'s cache with ``joining``'s rows appended, both left-padded to ``width`` columns."""
    for layer, new in zip(running.layers, joining.layers):
        layer.keys = torch.cat([_pad_left(layer.keys, width), _pad_left(new.keys, width)])
        layer.values = torch.cat([_pad_left(layer.values, width), _pad_left(new.values, width)])
    return running
