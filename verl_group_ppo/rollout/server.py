"""The ``hf`` rollout's server: a Ray actor that serves the agent loop's ``generate`` calls by continuous batching.

verl's agent loop calls ``generate`` (token-in/token-out) concurrently; the server gathers the first requests
(until no new one arrived for ``gather_window_s``, at most ``max_gather_s``) into a running batch
(:class:`verl_group_ppo.rollout.generation.RunningBatch`); requests that arrive while it decodes join it before its
next step, and each is answered with a ``TokenOutput`` as soon as its own reply stops; with
``enable_prefix_caching`` a request whose prompt continues a finished reply starts from that reply's cache
(:mod:`~verl_group_ppo.rollout.prefix_cache`). It generates on the
trainer's device kind (:mod:`~verl_group_ppo.rollout.model`), pauses and resumes for verl's partial rollout, and
takes the actor's weights from the adapter in buckets (:meth:`HFRolloutServer.load_weights`) between batches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from verl.workers.rollout.replica import TokenOutput
from verl_group_ppo.rollout.generation import Completion, RunningBatch, SamplingRequest
from verl_group_ppo.rollout.model import eos_and_pad, load_causal_lm, server_device, visible_device_count
from verl_group_ppo.rollout.prefix_cache import PrefixCache
from verl_group_ppo.rollout.requests import config_value, to_sampling_request

logger = logging.getLogger("verl_group_ppo.rollout")


def server_actor_name(replica_rank: int, name_suffix: str = "") -> str:
    """The Ray actor name of a replica's server (how the actor worker's adapter finds it)."""
    return f"verl_group_ppo_hf_rollout_{replica_rank}{name_suffix}"


@dataclass
class _Pending:
    """A request waiting for a batch, and the future its caller awaits."""

    request: SamplingRequest
    future: asyncio.Future


@dataclass
class _WeightUpdate:
    """Parameter names received so far in one weight sync."""

    received: set[str] = field(default_factory=set)


class HFRolloutServer:
    """A rollout server (run as a Ray actor) that decodes concurrent ``generate`` calls as one running batch.

    Partial rollout (verl's async trainers): :meth:`abort_all_requests` answers waiting requests at once and
    stops the running batch before its next token, each as ``stop_reason="aborted"`` with the tokens it
    has, then holds new requests until :meth:`resume_generation` (verl's client resubmits aborted requests
    with their tokens appended to the prompt).

    Args:
        config: the rollout config (``RolloutConfig`` or its DictConfig): lengths, ``seed``,
            ``max_num_seqs`` (most rows decoding at once), ``logprobs_mode``, ``ignore_eos``,
            ``enable_prefix_caching`` (default true: keep finished rows' cache for requests that continue them, at
            most ``max_num_seqs * (prompt_length + response_length)`` tokens, emptied at every weight load).
        model_config: the actor model config (``path``, ``override_config``, ``trust_remote_code``).
        replica_rank: this replica's rank (seeds the sampler with ``seed + replica_rank``).
        gather_window_s: an idle server starts decoding once no new request arrived for this long...
        max_gather_s: ...or this long after the first request arrived, or when ``max_num_seqs`` wait.
        model: an already-built causal LM to serve instead of loading ``model_config.path`` (tests).
        device_type: the device kind to generate on (``cpu``, ``cuda``; see
            :func:`~verl_group_ppo.rollout.model.server_device`); the model and the seeded sampler's generator
            are put there.
    """

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, gather_window_s: float = 0.02,
                 max_gather_s: float = 0.2, model: Any = None, device_type: str = "cpu") -> None:
        self.config = config
        self.replica_rank = replica_rank
        self.device = server_device(device_type, replica_rank, visible_device_count(device_type))
        model = model if model is not None else load_causal_lm(model_config)
        self.model = model.to(self.device)
        self.eos_token_ids, self.pad_token_id = eos_and_pad(self.model)
        if bool(config_value(config, "ignore_eos", False)):
            self.eos_token_ids = []
        seed = int(config_value(config, "seed", 0)) + replica_rank
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.gather_window_s, self.max_gather_s = gather_window_s, max_gather_s
        self.max_batch_size = int(config_value(config, "max_num_seqs", 256))
        self.logprobs_mode = str(config_value(config, "logprobs_mode", "processed_logprobs"))
        self.prefix_cache: Optional[PrefixCache] = None
        if bool(config_value(config, "enable_prefix_caching", True)):
            context = int(config_value(config, "prompt_length", 512)) + int(config_value(config, "response_length", 512))
            self.prefix_cache = PrefixCache(max_tokens=self.max_batch_size * context)
        self.global_steps: Optional[int] = None
        self.batch_sizes: list[int] = []  # how many requests joined the running batch each time any did, in order
        self._pending: list[_Pending] = []
        self._loop_state: Optional[_LoopState] = None
        self._paused, self._reject, self._aborting = False, False, False
        self._update = _WeightUpdate()

    @property
    def _state(self) -> _LoopState:
        """Events, lock and batching task, created on the actor's event loop at first use."""
        if self._loop_state is None:
            self._loop_state = _LoopState(asyncio.Event(), asyncio.Event(), asyncio.Lock())
            self._loop_state.resumed.set()
        return self._loop_state

    # ---------------------------------------------------------------- generation

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       **kwargs: Any) -> Any:
        """Token-in/token-out generation of one request (the call verl's ``LLMServerClient`` makes).

        Returns a ``TokenOutput`` with the response token ids, their log-probs when
        ``sampling_params["logprobs"]`` is true, ``stop_reason`` ``completed`` or ``aborted``, and the
        ``global_steps`` of the weights that produced them.
        """
        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("the hf rollout serves text-only prompts (got image/video/audio data)")
        params = dict(sampling_params)
        want_logprobs = bool(params.pop("logprobs", False))
        request = to_sampling_request(prompt_ids, params, self.config)
        if self._paused and self._reject:
            return _token_output(_ABORTED, self.global_steps, want_logprobs)
        await self._state.resumed.wait()
        completion, steps = await self._submit(request)
        return _token_output(completion, steps, want_logprobs)

    async def _submit(self, request: SamplingRequest) -> tuple[Completion, Optional[int]]:
        """Queue ``request`` for the next batch; wait for (its completion, the weights' global_steps)."""
        state = self._state
        if state.batcher is None or state.batcher.done():
            state.batcher = asyncio.get_running_loop().create_task(self._serve_batches())
        pending = _Pending(request, asyncio.get_running_loop().create_future())
        self._pending.append(pending)
        state.arrived.set()
        return await pending.future

    async def _serve_batches(self) -> None:
        """Forever: wait for requests, gather the first ones, and decode them as a running batch that later
        requests join between steps (:meth:`_decode`); the model lock is held while any row runs."""
        state = self._state
        while True:
            await state.arrived.wait()
            first = await self._gather()
            async with state.model_lock:
                await self._decode(first)

    async def _gather(self) -> list[_Pending]:
        """Wait until the arrivals pause (or the window or batch is full), then take up to a batch."""
        start, seen = time.monotonic(), -1
        while (len(self._pending) != seen and len(self._pending) < self.max_batch_size
               and time.monotonic() - start < self.max_gather_s):
            seen = len(self._pending)
            await asyncio.sleep(self.gather_window_s)
        return self._take(self.max_batch_size)

    def _take(self, room: int) -> list[_Pending]:
        """Up to ``room`` waiting requests, oldest first, taken off the queue."""
        taken, self._pending = self._pending[:room], self._pending[room:]
        if not self._pending:
            self._state.arrived.clear()
        return taken

    async def _decode(self, joining: list[_Pending]) -> None:
        """Run a :class:`~verl_group_ppo.rollout.generation.RunningBatch` until no row is left: before each
        decoding step (run off the event loop) the requests that arrived meanwhile join it, up to ``max_num_seqs``
        rows, and every row that stopped is answered at once. An abort stops every row before its next token."""
        steps = self.global_steps
        running = RunningBatch(self.model, self.eos_token_ids, self.pad_token_id, self.generator,
                               self.logprobs_mode, device=self.device, prefix_cache=self.prefix_cache)
        try:
            while joining or len(running):
                if joining:
                    self.batch_sizes.append(len(joining))
                stopped = await asyncio.to_thread(self._advance, running, [(p, p.request) for p in joining])
                _answer([pending for pending, _ in stopped], [(c, steps) for _, c in stopped])
                joining = self._joiners(running)
        except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the error
            waiting = running.keys() + joining  # (a joiner already among the rows is answered once)
            logger.error("hf rollout: batch of %d failed: %s", len(waiting), exc, exc_info=exc)
            _answer(waiting, exc)

    def _joiners(self, running: RunningBatch) -> list[_Pending]:
        """The waiting requests that join ``running`` before its next step: up to ``max_num_seqs`` rows in all;
        none during an abort, or while its cache cannot take rows (:meth:`RunningBatch.accepts_joins`)."""
        room = self.max_batch_size - len(running)
        if self._aborting or room <= 0 or not self._pending or not running.accepts_joins():
            return []
        return self._take(room)

    def _advance(self, running: RunningBatch,
                 joining: list[tuple[_Pending, SamplingRequest]]) -> list[tuple[_Pending, Completion]]:
        """In a worker thread: prefill the joining requests into ``running``, then one decoding step."""
        running.admit(joining)
        return running.step(should_abort=lambda: self._aborting)

    # ---------------------------------------------------------------- weights

    async def load_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: Optional[int] = None,
                           last: bool = True) -> int:
        """Copy one bucket of the actor's tensors into the model; on the ``last`` bucket check that every
        parameter of the model was received in this sync. Returns the number of tensors copied.

        Raises ``KeyError`` for a name the model does not have and ``ValueError`` for a shape mismatch or
        parameters that were never sent.
        """
        async with self._state.model_lock:
            if self.prefix_cache is not None:  # cached keys and values are the old weights'
                self.prefix_cache.clear()
            copied = _copy_into(self.model, named_tensors)
            self._update.received |= set(named_tensors)
            if last:
                missing = _unsynced_parameters(self.model, self._update.received)
                self._update = _WeightUpdate()
                if missing:
                    raise ValueError(f"hf rollout weight sync: the actor sent no tensor for {sorted(missing)[:8]}"
                                     f"{' ...' if len(missing) > 8 else ''} ({len(missing)} parameters)")
                self.global_steps = global_steps
        return copied

    async def state_dict(self) -> dict[str, torch.Tensor]:
        """A host copy of the served model's state dict (to check weight sync)."""
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.state_dict().items()}

    async def stats(self) -> dict[str, Any]:
        """How many requests joined the running batch each time any did (the first of a batch, then each group that
        joined it: prefilled, or from the prefix cache), in order; the weights' ``global_steps``; and the prefix cache's hits, misses and the prompt
        tokens its hits reused (zeros without one)."""
        cache = self.prefix_cache
        return {"batch_sizes": list(self.batch_sizes), "global_steps": self.global_steps,
                "prefix_hits": cache.hits if cache else 0, "prefix_misses": cache.misses if cache else 0,
                "prefix_reused_tokens": cache.reused_tokens if cache else 0}

    # ---------------------------------------------------------------- control plane

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """Pause: answer waiting requests and stop the running batch (``aborted``, tokens so far kept), then
        hold new requests until :meth:`resume_generation` (or answer them ``aborted`` if ``reject_request``)."""
        self._paused, self._reject = True, reject_request
        self._state.resumed.clear()
        waiting, self._pending = self._pending, []
        self._state.arrived.clear()
        _answer(waiting, [(_ABORTED, self.global_steps)] * len(waiting))
        self._aborting = True
        try:
            async with self._state.model_lock:  # the running batch, if any, has stopped
                pass
        finally:
            self._aborting = False
        return {"aborted_count": len(waiting), "request_ids": []}

    async def resume_generation(self) -> None:
        """Let held and new requests through again."""
        self._paused, self._reject = False, False
        self._state.resumed.set()

    async def wait_for_requests_to_drain(self) -> None:
        """Return once no request is waiting or running."""
        while self._pending or self._state.model_lock.locked():
            await asyncio.sleep(self.gather_window_s)

    # nothing to free or restore: the weights stay where they are and the KV cache lives per batch
    async def wake_up(self) -> None: return None
    async def sleep(self) -> None: return None
    async def clear_kv_cache(self) -> None: return None
    async def release_kv_cache(self) -> None: return None
    async def resume_kv_cache(self) -> None: return None
    async def start_profile(self, **kwargs: Any) -> None: return None
    async def stop_profile(self) -> None: return None


_ABORTED = Completion(token_ids=[], log_probs=[], stopped_at_eos=False, aborted=True)


@dataclass
class _LoopState:
    """What must be created on the server's event loop: arrivals, the resume gate, the model lock."""

    arrived: asyncio.Event
    resumed: asyncio.Event
    model_lock: asyncio.Lock
    batcher: Optional[asyncio.Task] = None


def _answer(batch: list[_Pending], results: Union[BaseException, list[Any]]) -> None:
    """Resolve each waiting future with its result (or all with the exception)."""
    for index, pending in enumerate(batch):
        if pending.future.done():
            continue
        if isinstance(results, BaseException):
            pending.future.set_exception(results)
        else:
            pending.future.set_result(results[index])


def _token_output(completion: Completion, global_steps: Optional[int], want_logprobs: bool) -> Any:
    """verl's ``TokenOutput`` for a completion."""
    return TokenOutput(token_ids=completion.token_ids, log_probs=completion.log_probs if want_logprobs else None,
                       stop_reason="aborted" if completion.aborted else "completed", num_preempted=0,
                       extra_fields={"global_steps": global_steps})


def _copy_into(model: torch.nn.Module, named_tensors: dict[str, torch.Tensor]) -> int:
    """Copy tensors into the model's parameters/buffers of the same name (cast to their dtype)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    with torch.no_grad():
        for name, tensor in named_tensors.items():
            if name not in targets:
                raise KeyError(f"hf rollout weight sync: the actor sent {name!r}, which the served model "
                               f"({type(model).__name__}) does not have")
            if tuple(targets[name].shape) != tuple(tensor.shape):
                raise ValueError(f"hf rollout weight sync: {name!r} has shape {tuple(tensor.shape)} from the actor, "
                                 f"{tuple(targets[name].shape)} in the served model")
            targets[name].copy_(tensor)
    return len(named_tensors)


def _unsynced_parameters(model: torch.nn.Module, received: set[str]) -> set[str]:
    """Names of the parameters of ``model`` that none of ``received`` wrote; a tied parameter (one tensor
    under several names, e.g. tied embeddings) counts as written when any of its names was received."""
    names_by_tensor: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_by_tensor.setdefault(id(parameter), []).append(name)
    return {names[0] for names in names_by_tensor.values() if not received.intersection(names)}
