"""Contract: the verl 0.9 internals the CPU backend (``verl_group_ppo.cpu``) and the ``hf`` rollout
(``verl_group_ppo.rollout``) rely on.

Each test checks one fact, by behaviour where that is cheap and by signature or source otherwise, and its
message names what changed in verl and which backend module depends on it. A failure here after a verl
upgrade means: read the named verl code again and adapt that module before trusting a CPU run.
"""

from __future__ import annotations

import inspect

import pytest


def _source(obj) -> str:
    return inspect.getsource(obj)


def _params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


# ==================================================================================================
# platform (verl_group_ppo/cpu/platform.py)


def test_platform_registry_and_verl_platform_env(monkeypatch):
    """What register_cpu_platform and check_active_platform rely on: a class registered under a name is found
    by it, VERL_PLATFORM picks the name, and get_platform builds that class once and caches the instance."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry, platform_manager

    from verl_group_ppo.cpu.platform import CPUPlatform

    monkeypatch.setattr(PlatformRegistry, "_platforms", dict(PlatformRegistry._platforms))
    monkeypatch.setattr(platform_manager, "_current_platform", None)
    PlatformRegistry.register("cpu")(CPUPlatform)
    assert PlatformRegistry.get("cpu") is CPUPlatform and "cpu" in PlatformRegistry.registered_names(), \
        "PlatformRegistry no longer finds a registered platform by its name (platform.py registers 'cpu')"
    monkeypatch.setenv("VERL_PLATFORM", " CPU ")
    assert platform_manager._detect_platform_name() == "cpu", \
        "verl no longer picks its platform from VERL_PLATFORM (platform_manager._detect_platform_name)"
    resolved = platform_manager.get_platform()
    assert type(resolved) is CPUPlatform and isinstance(resolved, PlatformBase), \
        f"get_platform() with VERL_PLATFORM=cpu built {type(resolved).__name__}, not the registered CPUPlatform"
    assert platform_manager.get_platform() is resolved, \
        "get_platform() no longer caches its platform (check_active_platform reads the cached one)"


def test_platform_base_abstract_interface_is_what_cpu_platform_implements():
    from verl.plugin.platform import PlatformBase

    from verl_group_ppo.cpu.platform import CPUPlatform

    expected = {
        "communication_backend_name", "cudart", "current_device", "device_count", "device_module", "device_name",
        "empty_cache", "get_device_capability", "is_available", "is_ipc_supported", "manual_seed",
        "manual_seed_all", "nvtx_range", "profiler_start", "profiler_stop", "ray_noset_envvars",
        "ray_resource_name", "set_allocator_settings", "set_device", "synchronize", "vendor_name",
        "visible_devices_envvar",
    }
    changed = set(PlatformBase.__abstractmethods__) ^ expected
    assert not changed, f"PlatformBase's abstract methods changed: {sorted(changed)} (update CPUPlatform)"
    CPUPlatform()  # raises TypeError if an abstract method is left unimplemented
    assert "resource_name == \"GPU\"" in _source(PlatformBase.ray_resource_options).replace("'", '"'), \
        "PlatformBase.ray_resource_options no longer maps resource 'GPU' to num_gpus"


def test_device_helpers_delegate_to_the_platform():
    import verl.utils.device as device

    for func, attribute in ((device.get_torch_device, "device_module"), (device.get_device_name, "device_name"),
                            (device.get_nccl_backend, "communication_backend_name"),
                            (device.get_resource_name, "ray_resource_name"), (device.get_device_id, "current_device")):
        assert f"get_platform().{attribute}" in _source(func), \
            f"verl.utils.device.{func.__name__} no longer returns get_platform().{attribute}"


def test_ray_resource_pools_count_the_platform_resource_as_gpus():
    from verl.single_controller.ray import base

    source = _source(base)
    assert "get_resource_name()" in source or "ray_resource_name()" in source, \
        "verl.single_controller.ray.base no longer asks the platform for its Ray resource name"


def test_device_module_calls_verl_makes_are_covered():
    """Every ``get_torch_device().<name>`` verl calls exists on the CPU device module."""
    import pathlib
    import re

    import verl

    from verl_group_ppo.cpu.platform import CPU_DEVICE_MODULE

    root = pathlib.Path(verl.__file__).parent
    called = set()
    for path in root.rglob("*.py"):
        called |= set(re.findall(r"get_torch_device\(\)\.([A-Za-z_]+)", path.read_text(errors="ignore")))
    missing = sorted(name for name in called if not hasattr(CPU_DEVICE_MODULE, name))
    assert not missing, f"verl now calls get_torch_device().{missing}: give the CPU device module an answer"


def test_flops_counter_reads_the_device_name():
    from verl.utils import flops_counter

    assert "get_torch_device().get_device_name()" in _source(flops_counter.get_device_flops), \
        "flops_counter.get_device_flops changed how it names the device (CPU device module answers 'CPU')"


# ==================================================================================================
# engine selection (platform.select_fsdp_engine)


def test_engine_lookup_honours_verl_engine_device_and_fsdp_is_registered_for_cuda():
    from verl.workers.engine.base import EngineRegistry

    import verl.workers.engine  # noqa: F401 - registers the engines

    assert 'os.getenv("VERL_ENGINE_DEVICE")' in _source(EngineRegistry.get_engine_cls), \
        "EngineRegistry.get_engine_cls no longer reads VERL_ENGINE_DEVICE"
    for kind in ("language_model", "value_model"):
        for backend in ("fsdp", "fsdp2"):
            assert "cuda" in EngineRegistry._engines[kind][backend], \
                f"no {kind}/{backend} engine registered for device 'cuda'"


# ==================================================================================================
# gloo backend string (verl_group_ppo/cpu/distributed.py)


def test_verl_builds_the_duplicate_backend_string_and_calls_torch_at_call_time():
    from verl.utils import distributed

    for func in (distributed.initialize_global_process_group, distributed.initialize_global_process_group_ray):
        source = _source(func)
        assert 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in source, \
            f"verl.utils.distributed.{func.__name__} builds its backend string differently now"
        assert "torch.distributed.init_process_group(" in source, \
            f"{func.__name__} no longer calls torch.distributed.init_process_group through the module"
    assert "backend" in _params(__import__("torch").distributed.init_process_group)


# ==================================================================================================
# FSDP1 on CPU ranks (verl_group_ppo/cpu/fsdp1.py)


from verl_group_ppo.cpu.patching import PATCH_MARK as ORIGINAL  # noqa: E402  (a run with VERL_PLATFORM=cpu has the patches installed)


def test_fsdp1_wrap_and_the_calls_the_patches_replace():
    from torch.distributed.fsdp import _flat_param, _init_utils
    from verl.utils import fsdp_utils
    from verl.workers.engine.fsdp import transformer_impl

    build = _source(transformer_impl.FSDPEngine._build_fsdp_module)
    assert "device_id=get_device_id()" in build and "sync_module_states=True" in build, \
        "verl's FSDP1 wrap changed its device_id / sync_module_states (fsdp1.patch_sync_module_states_check)"
    assert "_check_module_states_for_sync_module_states(module_states)" in \
        _source(_init_utils._sync_module_params_and_buffers), \
        "torch's FSDP1 no longer looks its sync_module_states check up in _init_utils at call time"
    load = getattr(fsdp_utils.load_fsdp_model_to_gpu, ORIGINAL, fsdp_utils.load_fsdp_model_to_gpu)
    assert 'f"{get_device_name()}:{device_id}"' in _source(load), \
        "verl.utils.fsdp_utils.load_fsdp_model_to_gpu builds its FSDP1 device differently (fsdp1.patch_load_fsdp_model)"
    assert "from verl.utils.fsdp_utils import" in _source(transformer_impl) and \
        "load_fsdp_model_to_gpu(self.module)" in _source(transformer_impl.FSDPEngine.get_per_tensor_param), \
        "verl's FSDP engine no longer binds load_fsdp_model_to_gpu from verl.utils.fsdp_utils"
    to_cpu = _source(getattr(_flat_param.FlatParamHandle.to_cpu, ORIGINAL, _flat_param.FlatParamHandle.to_cpu))
    assert 'self.flat_param_to(torch.device("cpu"))' in to_cpu and "self._free_unsharded_flat_param()" in to_cpu, \
        "torch's FlatParamHandle.to_cpu changed (fsdp1.patch_flat_param_to_cpu)"


# ==================================================================================================
# value head (verl_group_ppo/cpu/valuehead.py)


def test_value_model_loader_signature_and_lazy_import():
    import verl.utils.model as verl_model
    from verl.workers.engine.fsdp import transformer_impl

    assert _params(verl_model.load_valuehead_model) == ["local_path", "torch_dtype", "model_config",
                                                        "trust_remote_code"], \
        "verl.utils.model.load_valuehead_model changed its signature"
    assert "from verl.utils.model import load_valuehead_model" in _source(transformer_impl), \
        "the FSDP engine no longer imports load_valuehead_model at call time (patching the module would miss it)"


def test_override_config_attention_reaches_the_hf_config():
    from verl.workers.config import model

    assert 'self.override_config.get("attn_implementation", "flash_attention_2")' in _source(model.HFModelConfig), \
        "HFModelConfig no longer takes attn_implementation from override_config (flash_attention_2 default)"


# ==================================================================================================
# the hf rollout (verl_group_ppo/rollout/)


def test_rollout_registries():
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class

    assert isinstance(base._ROLLOUT_REGISTRY, dict) and ("vllm", "async") in base._ROLLOUT_REGISTRY, \
        "verl.workers.rollout.base._ROLLOUT_REGISTRY is gone or no longer keyed by (name, mode)"
    assert "_ROLLOUT_REGISTRY[(rollout_name, mode)]" in _source(base.get_rollout_class)
    assert _params(RolloutReplicaRegistry.register) == ["name", "loader"]
    assert "RolloutReplicaRegistry.get(rollout)" in _source(get_rollout_replica_class)


def test_base_rollout_interface():
    from verl.workers.rollout.base import BaseRollout

    assert set(BaseRollout.__abstractmethods__) == {"resume", "update_weights", "release"}, \
        f"BaseRollout's abstract methods are now {sorted(BaseRollout.__abstractmethods__)}"
    assert _params(BaseRollout.__init__)[:4] == ["self", "config", "model_config", "device_mesh"]
    assert _params(BaseRollout.update_weights)[:3] == ["self", "weights", "wire_format"]


def test_rollout_replica_interface():
    from verl.workers.rollout.replica import RolloutReplica

    assert set(RolloutReplica.__abstractmethods__) == {"launch_servers"}
    init = _source(RolloutReplica.__init__)
    for attribute in ("self.servers", "self._server_handle", "self._server_address", "self.name_suffix",
                      "self.replica_rank", "self.model_config"):
        assert attribute in init, f"RolloutReplica.__init__ no longer sets {attribute}"
    assert isinstance(RolloutReplica.max_concurrency, property)
    for control in ("wake_up", "sleep", "abort_all_requests", "resume_generation", "clear_kv_cache",
                    "release_kv_cache", "resume_kv_cache", "start_profile", "stop_profile"):
        assert f"server.{control}.remote(" in _source(getattr(RolloutReplica, control)), \
            f"RolloutReplica.{control} no longer calls server.{control}"


def test_token_output_fields():
    from verl.workers.rollout.replica import TokenOutput

    fields = set(TokenOutput.model_fields)
    assert {"token_ids", "log_probs", "stop_reason", "num_preempted", "extra_fields"} <= fields, \
        f"TokenOutput fields are now {sorted(fields)}"


def test_server_generate_call_and_sampling_params():
    from verl.experimental.agent_loop import agent_loop
    from verl.workers.rollout.llm_server import LLMServerClient

    call = _source(LLMServerClient.generate)
    for argument in ("request_id=", "prompt_ids=prompt_ids", "sampling_params=sampling_params", "image_data=",
                     "video_data="):
        assert argument in call, f"LLMServerClient.generate no longer passes {argument} to server.generate"
    loop = _source(agent_loop)
    for key in ("temperature=config.temperature", "top_p=config.top_p", "top_k=config.top_k",
                "logprobs=config.calculate_log_probs"):
        assert key in loop, f"the agent loop's sampling params no longer include {key}"


def test_naive_weight_sync_path():
    from verl.trainer.ppo.v1 import trainer_base
    from verl.workers.engine_workers import ActorRolloutRefWorker

    assert 'checkpoint_engine_config.backend = "naive"' in _source(trainer_base.PPOTrainer._setup) or \
        'checkpoint_engine_config.backend = "naive"' in _source(trainer_base), \
        "the v1 trainer no longer forces the naive checkpoint engine"
    update = _source(ActorRolloutRefWorker.update_weights)
    assert "get_per_tensor_param(" in update and "await self.rollout.update_weights(" in update, \
        "ActorRolloutRefWorker.update_weights no longer hands per-tensor params to rollout.update_weights"
    assert "get_rollout_class(rollout_config.name, rollout_config.mode)" in _source(ActorRolloutRefWorker), \
        "the actor worker no longer builds its rollout adapter through get_rollout_class"


@pytest.mark.parametrize("key", ["tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size",
                                 "prompt_length", "response_length", "max_model_len", "max_num_seqs",
                                 "logprobs_mode", "ignore_eos", "seed"])
def test_rollout_config_fields(key):
    from verl.workers.config import RolloutConfig

    assert key in RolloutConfig.__dataclass_fields__, f"RolloutConfig.{key} is gone (the hf rollout reads it)"


def test_checkpoint_engine_interface_for_separate_async():
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineWorker
    from verl.trainer.ppo.v1 import trainer_separate_async

    expected = {"prepare", "build_topology", "init_process_group", "finalize", "send_weights", "receive_weights"}
    assert set(CheckpointEngine.__abstractmethods__) == expected, \
        f"CheckpointEngine's abstract methods are now {sorted(CheckpointEngine.__abstractmethods__)} (checkpoint.py)"
    assert "import_external_libs(self.config.custom_backend_module" in _source(CheckpointEngineManager.__init__)
    assert "custom_backend_module" in _source(CheckpointEngineWorker.__init__), \
        "rollout workers no longer import checkpoint_engine.custom_backend_module (the engine would not register)"
    assert 'checkpoint_engine.backend != "naive"' in _source(trainer_separate_async), \
        "separate_async no longer refuses the naive engine (ray_object_store may no longer be needed)"


# ==================================================================================================
# replay-buffer poll interval (verl_group_ppo/rollout/sampler.py)


def test_custom_sampler_hook_and_the_kwargs_it_passes():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    src = _source(PPOTrainer._build_replay_buffer)
    assert "load_extern_type(custom_sampler.path, custom_sampler.name)" in src, \
        "the v1 trainer no longer loads trainer.v1.sampler.custom_sampler.{path,name} (sampler.py is not used)"
    for kwarg in ("trainer_mode=", "trainer_config=", "max_off_policy_threshold=", "max_off_policy_strategy=",
                  "sampler_kwargs=", "refill_fn="):
        assert kwarg in src, f"the v1 trainer no longer passes {kwarg[:-1]} to its sampler (sampler.py forwards it)"
    assert "if not has_custom_sampler:" in src, \
        "the v1 trainer changed which arguments a custom sampler misses (the launcher's DAPO exclusion in common.sh)"


def test_replay_buffer_sleeps_its_poll_interval_between_polls():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    assert "poll_interval" in _params(ReplayBuffer.__init__), "ReplayBuffer no longer takes poll_interval"
    assert issubclass(ReplayBufferAsync, ReplayBuffer)
    assert "time.sleep(self.poll_interval)" in _source(ReplayBuffer._wait_for_next_poll), \
        "the replay buffer no longer sleeps poll_interval between polls (sampler.py may be pointless or wrong)"
