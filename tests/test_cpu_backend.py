"""The CPU backend (``verl_group_ppo.cpu``): inert unless VERL_PLATFORM=cpu, then installed in the driver and
in Ray workers (the ``hf`` rollout, tests/test_rollout.py, registered by name on every platform); its platform,
gloo fix, FSDP1 patches, value-head loader and checkpoint engine. Models are tiny random Qwen2s built here (no
downloads)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch
import verl_group_ppo_testutils_cpu as cpu_utils
from omegaconf import OmegaConf

import verl_group_ppo.rollout as hf_rollout
from verl_group_ppo import cpu
from verl_group_ppo.cpu import distributed, fsdp1, platform, valuehead
from verl_group_ppo.cpu.patching import PATCH_MARK

# ==================================================================================================
# one switch: nothing without it, everything with it

STATE_PROBE = r"""
import json, os, sys
env_before = dict(os.environ)
import verl
backend_modules = sorted(m for m in sys.modules if m.startswith("verl_group_ppo.cpu."))
import torch.distributed, torch.distributed.fsdp._init_utils, verl.utils.model
from verl.plugin.platform import PlatformRegistry, get_platform
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from verl.workers.rollout.replica import RolloutReplicaRegistry
import verl_group_ppo.cpu as cpu
state = {
    "plugin_loaded": "verl_group_ppo.integration.entry_point" in sys.modules,
    "backend_modules": backend_modules,
    "env_added": sorted(k for k in os.environ if k not in env_before and not k.startswith("RAY_")),
    "cpu_platform_registered": "cpu" in PlatformRegistry.registered_names(),
    "hf_adapter": _ROLLOUT_REGISTRY.get(("hf", "async")),
    "hf_replica": "hf" in RolloutReplicaRegistry._registry,
    "init_pg_patched": hasattr(torch.distributed.init_process_group, "verl_group_ppo_cpu_original"),
    "valuehead_patched": hasattr(verl.utils.model.load_valuehead_model, "verl_group_ppo_cpu_original"),
    "fsdp1_patched": hasattr(torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states,
                             "verl_group_ppo_cpu_original"),
    "engine_device": os.environ.get("VERL_ENGINE_DEVICE"),
    "installed": cpu.install_if_requested(),
    "hf_rollout_imported": sorted(m for m in sys.modules if m.startswith("verl_group_ppo.rollout.")),
}
if state["installed"]:
    from verl.workers.engine.base import EngineRegistry
    state["platform"] = type(get_platform()).__name__
    state["engines"] = [EngineRegistry.get_engine_cls(kind, "fsdp2").__name__ for kind in ("language_model", "value_model")]
"""

RAY_PROBE = r"""
import ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote(max_calls=1)
def worker_state():
    import os, verl, verl_group_ppo.cpu as cpu
    from verl.plugin.platform import get_platform
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    return {"pid": os.getpid(), "installed": cpu._installed, "platform": type(get_platform()).__name__,
            "hf": ("hf", "async") in _ROLLOUT_REGISTRY, "engine_device": os.environ.get("VERL_ENGINE_DEVICE")}

@ray.remote(max_calls=1)
def rollout_module_first():
    # what a Ray actor unpickling the rollout server does: its first verl import comes from our module
    import sys
    assert "verl" not in sys.modules
    import verl_group_ppo.rollout.server, verl_group_ppo.cpu as cpu, verl_group_ppo.integration.failures as failures
    return {"installed": cpu._installed, "errors": [step for step, _ in failures.install_errors()]}

ray_state = ray.get(worker_state.remote())
ray_state["driver_pid"] = os.getpid()
ray_state["rollout_first"] = ray.get(rollout_module_first.remote())
ray.shutdown()
"""


@pytest.fixture(scope="module")
def cpu_platform_process() -> dict:
    """One fresh interpreter with VERL_PLATFORM=cpu: :data:`STATE_PROBE` right after ``import verl`` (under
    ``"state"``), then a local Ray with two workers (:data:`RAY_PROBE`, under ``"ray"``). Shared by
    :func:`test_backend_is_installed_by_import_verl_with_verl_platform_cpu` and
    :func:`test_ray_workers_install_the_backend`."""
    # a Ray start and two workers in one subprocess: allow for a loaded machine (300 s ran out at load ~5 on 2 cores)
    return cpu_utils.run_python(STATE_PROBE + RAY_PROBE + 'print(json.dumps({"state": state, "ray": ray_state}))\n',
                                platform="cpu", timeout=900)


@pytest.mark.slow
def test_backend_is_inert_without_verl_platform_cpu():
    """VERL_PLATFORM unset: importing verl loads our plugin, which changes neither torch nor the environment and
    installs no CPU platform; only the parts for every platform are there once verl imports their modules: the
    ``hf`` rollout, registered by name without importing it, the critic's value-model loader, and the start-up checks
    that read the config (``cpu.checks``: is there an accelerator or the CPU backend)."""
    state = cpu_utils.run_python(STATE_PROBE + "print(json.dumps(state))\n", platform=None)
    assert state["plugin_loaded"], "the verl-group-ppo plugin did not load; this test would prove nothing"
    assert set(state["backend_modules"]) <= {"verl_group_ppo.cpu.patching", "verl_group_ppo.cpu.valuehead",
                                             "verl_group_ppo.cpu.checks"}
    assert state["env_added"] == []
    assert not state["cpu_platform_registered"]
    assert state["hf_adapter"] == hf_rollout.ADAPTER_PATH and state["hf_replica"]
    assert state["hf_rollout_imported"] == []
    assert state["valuehead_patched"]
    assert not state["init_pg_patched"] and not state["fsdp1_patched"]
    assert state["engine_device"] is None
    assert state["installed"] is False


@pytest.mark.slow
def test_backend_is_installed_by_import_verl_with_verl_platform_cpu(cpu_platform_process):
    """VERL_PLATFORM=cpu alone: ``import verl`` installs every part, and verl's engine lookup finds FSDP."""
    state = cpu_platform_process["state"]
    assert state["installed"] is True
    assert state["platform"] == "CPUPlatform"
    assert state["hf_adapter"] == hf_rollout.ADAPTER_PATH and state["hf_replica"]
    assert state["init_pg_patched"] and state["valuehead_patched"] and state["fsdp1_patched"]
    assert state["engine_device"] == "cuda"
    assert state["engines"] == ["FSDPEngineWithLMHead", "FSDPEngineWithValueHead"]


def test_failed_install_is_logged_and_raised(monkeypatch, caplog):
    def broken() -> None:
        raise ImportError("no such thing")

    monkeypatch.setenv("VERL_PLATFORM", "CPU ")
    monkeypatch.setattr(cpu, "_installed", False)
    monkeypatch.setattr(cpu, "_install", broken)
    with caplog.at_level(logging.ERROR, logger="verl_group_ppo.cpu"):
        with pytest.raises(cpu.CPUBackendError, match="no such thing"):
            cpu.install_if_requested()
    assert any("install failed" in record.getMessage() for record in caplog.records)


@pytest.mark.slow
def test_ray_workers_install_the_backend(cpu_platform_process):
    """Every Ray worker that imports verl runs the backend's install (not only the driver)."""
    state = cpu_platform_process["ray"]
    assert state["pid"] != state["driver_pid"]
    assert state == {**state, "installed": True, "platform": "CPUPlatform", "hf": True, "engine_device": "cuda"}
    assert state["rollout_first"] == {"installed": True, "errors": []}


# ==================================================================================================
# platform, gloo, value head


def test_cpu_platform_answers():
    p = platform.CPUPlatform()
    assert (p.device_name, p.vendor_name, p.communication_backend_name()) == ("cpu", "cpu", "gloo")
    assert p.ray_resource_name() == "GPU" and p.ray_resource_options(2) == {"num_gpus": 2}
    assert p.current_device() == "cpu" and torch.zeros(1).to(device=p.current_device()).device.type == "cpu"
    assert not p.is_platform_available(use_smi_check=True), "cpu must never be auto-detected"
    module = p.device_module
    available, total = module.mem_get_info()
    assert 0 < available <= total
    assert module.get_device_name() == "CPU" and module.max_memory_allocated() == 0
    state = module.get_rng_state()
    first = torch.rand(3)
    module.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    with pytest.raises(AttributeError, match="cudaHostAlloc"):
        module.cudaHostAlloc  # noqa: B018 - a call verl never made must not be answered silently


def test_register_cpu_platform_is_idempotent():
    from verl.plugin.platform import PlatformRegistry

    saved = dict(PlatformRegistry._platforms)
    try:
        platform.register_cpu_platform()
        platform.register_cpu_platform()
        assert PlatformRegistry.get("cpu") is platform.CPUPlatform
    finally:
        PlatformRegistry._platforms.clear()
        PlatformRegistry._platforms.update(saved)


@pytest.mark.parametrize("given, expected", [
    ("cpu:gloo,cpu:gloo", "cpu:gloo"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    ("gloo", "gloo"),
    (None, None),
])
def test_dedupe_backend_string(given, expected):
    assert distributed.dedupe_backend_string(given) == expected


def test_dedupe_backend_string_refuses_two_backends_for_one_device():
    with pytest.raises(ValueError, match="two backends for device 'cpu'"):
        distributed.dedupe_backend_string("cpu:gloo,cpu:mpi")


def test_patched_init_process_group_starts_gloo_from_verls_string(monkeypatch, tmp_path):
    """verl's ``cpu:gloo,cpu:gloo`` starts a real one-rank gloo group through the patched function."""
    monkeypatch.setattr(torch.distributed, "init_process_group", torch.distributed.init_process_group)
    distributed.patch_init_process_group()
    patched = torch.distributed.init_process_group
    distributed.patch_init_process_group()
    assert torch.distributed.init_process_group is patched, "a second patch must not wrap twice"
    patched(backend="cpu:gloo,cpu:gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        total = torch.ones(2)
        torch.distributed.all_reduce(total)
        assert "gloo" in torch.distributed.get_backend() and total.tolist() == [1.0, 1.0]
    finally:
        torch.distributed.destroy_process_group()


def _fsdp1_targets() -> dict:
    """What the FSDP1 patches replace: torch's sync_module_states check, verl's FSDP model load, torch's
    FlatParamHandle.to_cpu."""
    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from verl.utils import fsdp_utils

    return {"check": _init_utils._check_module_states_for_sync_module_states,
            "load": fsdp_utils.load_fsdp_model_to_gpu, "to_cpu": FlatParamHandle.to_cpu}


def _keep_fsdp1_targets(monkeypatch) -> dict:
    """Record the FSDP1 patch targets so that the test's monkeypatch restores them; return them."""
    import sys

    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from verl.utils import fsdp_utils

    targets = _fsdp1_targets()
    monkeypatch.setattr(_init_utils, "_check_module_states_for_sync_module_states", targets["check"])
    monkeypatch.setattr(fsdp_utils, "load_fsdp_model_to_gpu", targets["load"])
    monkeypatch.setattr(FlatParamHandle, "to_cpu", targets["to_cpu"])
    engine = sys.modules.get(fsdp1.ENGINE_MODULE)
    if engine is not None:
        monkeypatch.setattr(engine, "load_fsdp_model_to_gpu", engine.load_fsdp_model_to_gpu)
    return targets


def test_fsdp1_patches_are_installed_with_verl_platform_cpu_only(monkeypatch):
    """The backend's install applies the three FSDP1 patches under VERL_PLATFORM=cpu and leaves torch and verl
    alone without it (the other install steps are stubbed: this process keeps its own platform)."""
    original = _keep_fsdp1_targets(monkeypatch)
    for module, name in ((platform, "register_cpu_platform"), (platform, "check_active_platform"),
                         (platform, "select_fsdp_engine"), (distributed, "patch_init_process_group"),
                         (valuehead, "patch_valuehead_loader")):
        monkeypatch.setattr(module, name, lambda: None)
    monkeypatch.setattr(cpu, "_installed", False)

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert cpu.install_if_requested() is False
    assert _fsdp1_targets() == original

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert cpu.install_if_requested() is True
    patched = _fsdp1_targets()
    for name, function in patched.items():
        assert function is not original[name] and getattr(function, PATCH_MARK) is original[name], name
    fsdp1.patch_fsdp1()
    assert _fsdp1_targets() == patched, "a second install must not wrap twice"


def test_fsdp1_wraps_with_sync_module_states_over_one_rank_gloo(monkeypatch, tmp_path):
    """verl's FSDP1 wrap (device_id "cpu", sync_module_states=True) fails on CPU without the patches and runs
    with them; the model load and the flat parameter's CPU offload then leave the weights as they are."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from verl.utils import fsdp_utils

    _keep_fsdp1_targets(monkeypatch)
    assert not fsdp1.cpu_states_can_sync([torch.zeros(1)]), "no process group: nothing carries the broadcast"
    torch.distributed.init_process_group(backend="gloo", init_method=f"file://{tmp_path}/store", rank=0,
                                         world_size=1)
    try:
        torch.manual_seed(0)
        with pytest.raises(ValueError, match="CPU parameters or buffers"):
            FSDP(torch.nn.Linear(4, 3), device_id="cpu", sync_module_states=True)
        assert fsdp1.cpu_states_can_sync([torch.zeros(1)])
        assert not fsdp1.cpu_states_can_sync([torch.zeros(1), torch.zeros(1, device="meta")])
        fsdp1.patch_fsdp1()
        linear = torch.nn.Linear(4, 3)
        weights = {k: v.clone() for k, v in linear.state_dict().items()}
        model = FSDP(linear, device_id="cpu", sync_module_states=True)
        fsdp_utils.load_fsdp_model_to_gpu(model)
        handle = model._handle
        with handle.to_cpu():
            assert handle.flat_param.untyped_storage().size() > 0
        x = torch.randn(2, 4)
        assert torch.allclose(model(x), x @ weights["weight"].T + weights["bias"])
        with FSDP.summon_full_params(model):
            assert torch.equal(model.weight, weights["weight"]) and torch.equal(model.bias, weights["bias"])
    finally:
        torch.distributed.destroy_process_group()


def test_valuehead_loader_uses_configured_attention(tmp_path, monkeypatch):
    import verl.utils.model as verl_model
    from transformers import AutoConfig

    cpu_utils.save_tiny_qwen2(str(tmp_path))
    monkeypatch.setattr(verl_model, "load_valuehead_model", verl_model.load_valuehead_model)
    valuehead.patch_valuehead_loader()
    config = AutoConfig.from_pretrained(str(tmp_path), attn_implementation="sdpa")
    config.num_labels = 1
    model = verl_model.load_valuehead_model(str(tmp_path), torch.float32, config, False)
    assert type(model).__name__ == "Qwen2ForTokenClassification"
    assert model.config._attn_implementation == "sdpa" and model.score.out_features == 1
    flash = SimpleNamespace(_attn_implementation="flash_attention_2")
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match=r"override_config.attn_implementation=sdpa"):
            verl_model.load_valuehead_model(str(tmp_path), torch.float32, flash, False)


def test_valuehead_patch_checks_its_target_and_names_it():
    """The loader replacement refuses a verl whose ``load_valuehead_model`` is missing or takes other
    parameters, naming the function; verl 0.9.1's passes."""
    import verl.utils.model as verl_model

    from verl_group_ppo.cpu.patching import PatchTargetError, check_target

    check_target(verl_model, "load_valuehead_model", valuehead.LOADER_PARAMETERS)
    changed = SimpleNamespace(__name__="verl.utils.model", load_valuehead_model=lambda path, dtype, config, remote: 0)
    with pytest.raises(PatchTargetError, match=r"verl\.utils\.model\.load_valuehead_model takes \['path'"):
        check_target(changed, "load_valuehead_model", valuehead.LOADER_PARAMETERS)
    with pytest.raises(PatchTargetError, match="does not exist"):
        check_target(SimpleNamespace(__name__="verl.utils.model"), "load_valuehead_model", valuehead.LOADER_PARAMETERS)


def test_critic_attention_is_read_from_the_config_with_verls_default():
    assert valuehead.critic_attention({}) == "flash_attention_2"
    assert valuehead.critic_attention(OmegaConf.create({"critic": {"model": {"override_config": {}}}})) \
        == "flash_attention_2"
    sdpa = OmegaConf.create({"critic": {"model": {"override_config": {"attn_implementation": "sdpa"}}}})
    assert valuehead.critic_attention(sdpa) == "sdpa"
    valuehead.check_critic_attention(sdpa)


def test_plugin_installs_the_valuehead_loader_on_any_platform(monkeypatch):
    """The plugin's install (run when verl imports ``verl.utils.model``) replaces verl's value-model loader by
    ours, which keeps verl's as the one it wraps, whatever VERL_PLATFORM says."""
    import verl.utils.model as verl_model

    from verl_group_ppo.integration import entry_point

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    verls_own = getattr(verl_model.load_valuehead_model, PATCH_MARK, verl_model.load_valuehead_model)
    monkeypatch.setattr(verl_model, "load_valuehead_model", verls_own)
    entry_point.install_valuehead_loader(verl_model)
    assert verl_model.load_valuehead_model is not verls_own
    assert getattr(verl_model.load_valuehead_model, PATCH_MARK) is verls_own


# ==================================================================================================
# weight sync for separate_async: Ray's object store


@pytest.mark.slow
def test_ray_object_store_checkpoint_engine_moves_weights_exactly(local_ray):
    """separate_async's weight path on CPU: the actor's rank 0 publishes, a rollout worker receives the same
    tensors for the same global_steps (a non-master sender publishes nothing)."""
    from verl_group_ppo.cpu.checkpoint import RayObjectStoreCheckpointEngine

    actor = cpu_utils.tiny_qwen2(seed=2)
    sender = RayObjectStoreCheckpointEngine(bucket_size=20_000, is_master=True)
    bystander = RayObjectStoreCheckpointEngine(bucket_size=20_000, is_master=False)
    receiver = RayObjectStoreCheckpointEngine(bucket_size=20_000)

    async def sync(steps):
        async def receive():
            return [(name, tensor) async for name, tensor in receiver.receive_weights(global_steps=steps)]

        received = asyncio.ensure_future(receive())
        await bystander.send_weights(iter(list(actor.named_parameters())), global_steps=steps)
        await sender.send_weights(iter(list(actor.named_parameters())), global_steps=steps)
        return await received

    received = asyncio.run(sync(5))
    expected = dict(actor.named_parameters())
    assert [name for name, _ in received] == list(expected)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in received)
