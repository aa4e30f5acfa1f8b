"""The ``hf`` rollout: verl's rollout interfaces served by a Hugging Face model, on the trainer's device.

verl's rollout has three parts, each given here. The plugin registers them under the name ``hf`` on every
platform (:func:`verl_group_ppo.cpu.register_hf_replica`, :func:`verl_group_ppo.cpu.register_hf_adapter`),
so ``actor_rollout_ref.rollout.name=hf`` selects it on CPU and on CUDA alike; nothing of this module is
imported unless a run selects it.

* :class:`HFRolloutReplica` (a ``RolloutReplica``, registered as ``hf`` in ``RolloutReplicaRegistry``):
  starts one :class:`HFRolloutServer` Ray actor per replica, on the device kind the trainer uses
  (verl's ``get_device_name()``: ``cpu`` under the CPU backend, ``cuda`` on GPUs).
* :class:`HFRolloutServer` (a Ray actor): the agent loop's token-in/token-out ``generate`` calls arrive
  concurrently; the server gathers the waiting requests (until no new one arrived for
  ``gather_window_s``, at most ``max_gather_s``) and generates them as one left-padded batch
  (:func:`verl_group_ppo.cpu.generation.generate_batch`), answering each with a ``TokenOutput``.
* :class:`HFRolloutAdapter` (a ``BaseRollout``, registered in ``_ROLLOUT_REGISTRY[("hf", "async")]``),
  lives in the actor worker; verl's "naive" weight sync hands it the actor's full tensors, and its
  replica's leader rank forwards them to the server, which copies them into its model and checks that
  every parameter was received.

On CUDA the server reserves no GPU from Ray (the trainer's placement groups hold them all) and generates on
GPU ``replica_rank % device_count`` (:func:`server_device`); it sees the GPUs because Ray leaves
``CUDA_VISIBLE_DEVICES`` alone for an actor with ``num_gpus=0`` unless ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional, Union

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl_group_ppo.cpu.generation import Completion, SamplingRequest, generate_batch

logger = logging.getLogger("verl_group_ppo.cpu")

WEIGHT_BUCKET_BYTES = 256 << 20
"""Weight sync sends the actor's tensors to the server in buckets of about this many bytes."""


def server_actor_name(replica_rank: int, name_suffix: str = "") -> str:
    """The Ray actor name of a replica's server (how the actor worker's adapter finds it)."""
    return f"verl_group_ppo_hf_rollout_{replica_rank}{name_suffix}"


def server_device(device_type: str, replica_rank: int, device_count: int) -> torch.device:
    """The device a replica's server generates on: ``cpu``, or accelerator ``replica_rank % device_count``
    of kind ``device_type`` (``cuda``, ``npu``, ...). Raises ``RuntimeError`` when an accelerator kind is
    asked for and the server's process sees none."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_count < 1:
        raise RuntimeError(f"hf rollout: the trainer runs on {device_type!r} but the rollout server's process sees "
                           f"no {device_type} device (is RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 or "
                           f"CUDA_VISIBLE_DEVICES empty in the Ray workers' environment?)")
    return torch.device(device_type, replica_rank % device_count)


def visible_device_count(device_type: str) -> int:
    """How many devices of kind ``device_type`` this process sees (0 for ``cpu`` or an unknown kind)."""
    module = getattr(torch, device_type, None) if device_type != "cpu" else None
    if module is None or not module.is_available():
        return 0
    return int(module.device_count())


def trainer_device_type() -> str:
    """The device kind the trainer runs on, as verl resolves it in this process (``cpu``, ``cuda``, ...)."""
    from verl.utils.device import get_device_name

    return str(get_device_name())


def _get(config: Any, key: str, default: Any = None) -> Any:
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
                         f"{context} tokens (actor_rollout_ref.rollout.max_model_len / prompt_length + response_length)")
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
    max_tokens = resolve_max_tokens(sampling_params, len(prompt), int(_get(config, "prompt_length", 512)),
                                    int(_get(config, "response_length", 512)), _get(config, "max_model_len"))
    return SamplingRequest(prompt_ids=prompt, max_tokens=max_tokens,
                           temperature=float(sampling_params.get("temperature", 1.0)),
                           top_p=float(sampling_params.get("top_p", 1.0)),
                           top_k=int(sampling_params.get("top_k", -1) or -1))


def model_attention(model_config: Any) -> str:
    """The attention implementation configured for the actor model (``override_config.attn_implementation``),
    ``sdpa`` when none is configured; raises ``ValueError`` for flash-attn without the package."""
    from verl_group_ppo.cpu.valuehead import check_attention_available

    attention = _get(_get(model_config, "override_config", {}), "attn_implementation", "sdpa")
    check_attention_available(str(attention))
    return str(attention)


def load_causal_lm(model_config: Any) -> Any:
    """The actor's HF causal LM in float32 on the CPU (the server moves it to its device), in eval mode, from
    ``model_config.path``."""
    from transformers import AutoModelForCausalLM

    from verl.utils.fs import copy_to_local

    path = copy_to_local(str(_get(model_config, "local_path") or _get(model_config, "path")))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=model_attention(
        model_config), trust_remote_code=bool(_get(model_config, "trust_remote_code", False)))
    return model.eval()


def eos_and_pad(model: Any) -> tuple[list[int], int]:
    """(EOS token ids, pad token id) from the model's generation config, then its config (a response stops
    at any of the EOS ids, as vLLM stops at the generation config's ``eos_token_id``)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return eos_ids, int(pad if pad is not None else (eos_ids[0] if eos_ids else 0))


# ==================================================================================================
# the server


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
    """A rollout server (run as a Ray actor) that batches concurrent ``generate`` calls.

    Partial rollout (verl's async trainers): :meth:`abort_all_requests` answers waiting requests at once and
    stops the running batch before its next token, each as ``stop_reason="aborted"`` with the tokens it
    has, then holds new requests until :meth:`resume_generation` (verl's client resubmits aborted requests
    with their tokens appended to the prompt).

    Args:
        config: the rollout config (``RolloutConfig`` or its DictConfig): lengths, ``seed``,
            ``max_num_seqs`` (largest batch), ``logprobs_mode``, ``ignore_eos``.
        model_config: the actor model config (``path``, ``override_config``, ``trust_remote_code``).
        replica_rank: this replica's rank (seeds the sampler with ``seed + replica_rank``).
        gather_window_s: a batch closes once no new request arrived for this long...
        max_gather_s: ...or this long after its first request arrived, or when it holds ``max_num_seqs``.
        model: an already-built causal LM to serve instead of loading ``model_config.path`` (tests).
        device_type: the device kind to generate on (``cpu``, ``cuda``; see :func:`server_device`); the
            model and the seeded sampler's generator are put there.
    """

    def __init__(self, config: Any, model_config: Any, replica_rank: int = 0, gather_window_s: float = 0.02,
                 max_gather_s: float = 0.2, model: Any = None, device_type: str = "cpu") -> None:
        self.config = config
        self.replica_rank = replica_rank
        self.device = server_device(device_type, replica_rank, visible_device_count(device_type))
        model = model if model is not None else load_causal_lm(model_config)
        self.model = model.to(self.device)
        self.eos_token_ids, self.pad_token_id = eos_and_pad(self.model)
        if bool(_get(config, "ignore_eos", False)):
            self.eos_token_ids = []
        self.generator = torch.Generator(device=self.device).manual_seed(int(_get(config, "seed", 0)) + replica_rank)
        self.gather_window_s, self.max_gather_s = gather_window_s, max_gather_s
        self.max_batch_size = int(_get(config, "max_num_seqs", 256))
        self.logprobs_mode = str(_get(config, "logprobs_mode", "processed_logprobs"))
        self.global_steps: Optional[int] = None
        self.batch_sizes: list[int] = []
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
        """Forever: wait for requests, gather a batch, generate it off the event loop, answer each caller."""
        state = self._state
        while True:
            await state.arrived.wait()
            batch = await self._gather()
            try:
                async with state.model_lock:
                    steps = self.global_steps
                    completions = await asyncio.to_thread(self._generate, [p.request for p in batch])
            except Exception as exc:  # noqa: BLE001 - every waiting caller gets the error
                logger.error("hf rollout: batch of %d failed: %s", len(batch), exc, exc_info=exc)
                _answer(batch, exc)
                continue
            _answer(batch, [(completion, steps) for completion in completions])

    async def _gather(self) -> list[_Pending]:
        """Wait until the arrivals pause (or the window or batch is full), then take up to a batch."""
        start, seen = time.monotonic(), -1
        while (len(self._pending) != seen and len(self._pending) < self.max_batch_size
               and time.monotonic() - start < self.max_gather_s):
            seen = len(self._pending)
            await asyncio.sleep(self.gather_window_s)
        batch, self._pending = self._pending[:self.max_batch_size], self._pending[self.max_batch_size:]
        if not self._pending:
            self._state.arrived.clear()
        return batch

    def _generate(self, requests: list[SamplingRequest]) -> list[Completion]:
        """Run one batch through the model (in a worker thread); an abort stops it before its next token."""
        if not requests:
            return []
        self.batch_sizes.append(len(requests))
        return generate_batch(self.model, requests, self.eos_token_ids, self.pad_token_id, self.generator,
                              self.logprobs_mode, should_abort=lambda: self._aborting, device=self.device)

    # ---------------------------------------------------------------- weights

    async def load_weights(self, named_tensors: dict[str, torch.Tensor], global_steps: Optional[int] = None,
                           last: bool = True) -> int:
        """Copy one bucket of the actor's tensors into the model; on the ``last`` bucket check that every
        parameter of the model was received in this sync. Returns the number of tensors copied.

        Raises ``KeyError`` for a name the model does not have and ``ValueError`` for a shape mismatch or
        parameters that were never sent.
        """
        async with self._state.model_lock:
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
        """The sizes of the batches generated so far and the weights' ``global_steps``."""
        return {"batch_sizes": list(self.batch_sizes), "global_steps": self.global_steps}

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


# ==================================================================================================
# the replica


class HFRolloutReplica(RolloutReplica):
    """One :class:`HFRolloutServer` per replica; it reserves no accelerator from Ray and generates on the
    trainer's device kind (:func:`trainer_device_type`)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        """Start the replica's server actor and wait until its model is loaded."""
        name = server_actor_name(self.replica_rank, self.name_suffix)
        server = ray.remote(HFRolloutServer).options(
            name=name, num_cpus=0, max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank,
                 device_type=trainer_device_type())
        await server.stats.remote()  # surfaces a failed model load here, not at the first request
        self.servers = [server]
        self._server_handle = server
        self._server_address = name


# ==================================================================================================
# the adapter in the actor worker (weight sync)


async def _iterate(weights: Union[Iterable, AsyncIterator]) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from a sync or async iterable."""
    if inspect.isasyncgen(weights) or hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _buckets_sizes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class HFRolloutAdapter(BaseRollout):
    """verl's ``BaseRollout`` for the ``hf`` rollout: forwards the actor's weights to the replica's server.

    Every rank iterates the weights (the FSDP engine gathers full tensors collectively); the leader rank
    of each replica sends them, in buckets of ``bucket_bytes`` (:data:`WEIGHT_BUCKET_BYTES`), to its server.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, replica_rank: int = -1,
                 **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % world == 0
        self.bucket_bytes = WEIGHT_BUCKET_BYTES
        self._server: Any = None

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    def server(self) -> Any:
        """The replica's server actor handle (looked up by name once)."""
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Send the actor's full tensors to the server (leader rank); other ranks only consume them."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes wire_format='named_tensors' weights, got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("the hf rollout does not take LoRA adapter weights; set "
                                      "actor_rollout_ref.model.lora.merge=True")
        bucket: dict[str, torch.Tensor] = {}
        size, steps = 0, kwargs.get("global_steps")
        async for name, tensor in _iterate(weights):
            if not self.is_leader_rank:
                continue
            bucket[name] = tensor.detach().to("cpu", copy=True)
            size += _buckets_sizes(tensor)
            if size >= self.bucket_bytes:
                await self.server().load_weights.remote(bucket, steps, last=False)
                bucket, size = {}, 0
        if self.is_leader_rank:
            await self.server().load_weights.remote(bucket, steps, last=True)
