"""The CPU backend (``verl_group_ppo.cpu``): inert unless VERL_PLATFORM=cpu, then installed in the driver and
in Ray workers; its platform, gloo fix, FSDP1 patches and value-head loader; the ``hf`` rollout's batching, sampling,
log-probs, EOS handling and exact weight sync. Models are tiny random Qwen2s built here (no downloads)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch
import verl_group_ppo_testutils_cpu as cpu_utils
from omegaconf import OmegaConf

from verl_group_ppo import cpu
from verl_group_ppo.cpu import distributed, fsdp1, generation, platform, rollout, valuehead
from verl_group_ppo.cpu.generation import SamplingRequest, generate_batch
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
    "hf_rollout_imported": "verl_group_ppo.cpu.rollout" in sys.modules,
}
if state["installed"]:
    from verl.workers.engine.base import EngineRegistry
    state["platform"] = type(get_platform()).__name__
    state["engines"] = [EngineRegistry.get_engine_cls(kind, "fsdp2").__name__ for kind in ("language_model", "value_model")]
print(json.dumps(state))
"""


@pytest.mark.slow
def test_backend_is_inert_without_verl_platform_cpu():
    """VERL_PLATFORM unset: importing verl loads our plugin, which changes neither torch nor the environment and
    installs no CPU platform; only the parts for every platform are there once verl imports their modules: the
    ``hf`` rollout, registered by name without importing it, and the critic's value-model loader."""
    state = cpu_utils.run_python(STATE_PROBE, platform=None)
    assert state["plugin_loaded"], "the verl-group-ppo plugin did not load; this test would prove nothing"
    assert set(state["backend_modules"]) <= {"verl_group_ppo.cpu.patching", "verl_group_ppo.cpu.valuehead"}
    assert state["env_added"] == []
    assert not state["cpu_platform_registered"]
    assert state["hf_adapter"] == cpu.ADAPTER_PATH and state["hf_replica"]
    assert not state["hf_rollout_imported"]
    assert state["valuehead_patched"]
    assert not state["init_pg_patched"] and not state["fsdp1_patched"]
    assert state["engine_device"] is None
    assert state["installed"] is False


@pytest.mark.slow
def test_backend_is_installed_by_import_verl_with_verl_platform_cpu():
    """VERL_PLATFORM=cpu alone: ``import verl`` installs every part, and verl's engine lookup finds FSDP."""
    state = cpu_utils.run_python(STATE_PROBE, platform="cpu")
    assert state["installed"] is True
    assert state["platform"] == "CPUPlatform"
    assert state["hf_adapter"] == cpu.ADAPTER_PATH and state["hf_replica"]
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
def test_ray_workers_install_the_backend():
    """Every Ray worker that imports verl runs the backend's install (not only the driver)."""
    probe = r"""
import json, os, ray
import verl
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
    import verl_group_ppo.cpu.rollout, verl_group_ppo.cpu as cpu, verl_group_ppo.integration.failures as failures
    return {"installed": cpu._installed, "errors": [step for step, _ in failures.install_errors()]}

state = ray.get(worker_state.remote())
state["driver_pid"] = os.getpid()
state["rollout_first"] = ray.get(rollout_module_first.remote())
ray.shutdown()
print(json.dumps(state))
"""
    # two Ray starts in one subprocess: allow for a loaded machine (300 s ran out at load ~5 on 2 cores)
    state = cpu_utils.run_python(probe, platform="cpu", timeout=900)
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
                         (valuehead, "patch_valuehead_loader"), (cpu, "_register_hf_rollout")):
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


def test_plugin_registers_the_hf_rollout_and_loader_on_any_platform(monkeypatch):
    """The plugin's installs (run when verl imports each module) register ``hf`` by name and the loader,
    whatever VERL_PLATFORM says."""
    import verl.utils.model as verl_model
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout import replica as rollout_replica

    from verl_group_ppo.integration import entry_point

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr(rollout_base, "_ROLLOUT_REGISTRY", {})
    monkeypatch.setattr(rollout_replica.RolloutReplicaRegistry, "_registry", {})
    monkeypatch.setattr(verl_model, "load_valuehead_model", getattr(verl_model.load_valuehead_model, PATCH_MARK,
                                                                    verl_model.load_valuehead_model))
    entry_point.install_hf_adapter(rollout_base)
    entry_point.install_hf_replica(rollout_replica)
    entry_point.install_valuehead_loader(verl_model)
    assert rollout_base.get_rollout_class("hf") is rollout.HFRolloutAdapter
    assert rollout_replica.get_rollout_replica_class("hf") is rollout.HFRolloutReplica
    assert getattr(verl_model.load_valuehead_model, PATCH_MARK, None) is not None


# ==================================================================================================
# batched generation


def _requests(lengths, max_tokens=8, temperature=0.0, **kwargs):
    prompts = [[(7 * i + 3 * j) % (cpu_utils.VOCAB - 2) + 2 for j in range(n)] for i, n in enumerate(lengths)]
    return [SamplingRequest(tuple(p), max_tokens=max_tokens, temperature=temperature, **kwargs) for p in prompts]


def test_left_pad_and_positions():
    ids, mask = generation.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert generation.position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


def test_top_k_top_p_filter():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    kept = generation.filter_top_k_top_p(logits, torch.tensor([1, -1, -1]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.isfinite(kept).tolist() == [[True, False, False, False], [True] * 4, [True, False, False, False]]


def test_batched_greedy_equals_each_request_alone_and_hf_generate():
    """Left padding changes nothing: each row of a mixed-length batch matches its own unpadded run."""
    model = cpu_utils.tiny_qwen2()
    requests = _requests([3, 9, 5, 12])
    batched = generate_batch(model, requests, eos_token_ids=[], pad_token_id=cpu_utils.PAD_ID)
    for request, completion in zip(requests, batched):
        alone = generate_batch(model, [request], eos_token_ids=[], pad_token_id=cpu_utils.PAD_ID)[0]
        assert completion.token_ids == alone.token_ids
        assert completion.log_probs == pytest.approx(alone.log_probs, abs=1e-5)
    reference = model.generate(torch.tensor([requests[1].prompt_ids]), do_sample=False, max_new_tokens=8,
                               min_new_tokens=8, pad_token_id=cpu_utils.PAD_ID)
    assert batched[1].token_ids == reference[0, len(requests[1].prompt_ids):].tolist()


def test_sampled_log_probs_are_those_of_the_sampling_distribution():
    """Log-probs of sampled tokens (temperature 0.7) equal a teacher-forced recomputation of
    log_softmax(logits / 0.7) at each response position."""
    model = cpu_utils.tiny_qwen2()
    requests = _requests([4, 7], max_tokens=6, temperature=0.7)
    completions = generate_batch(model, requests, [], cpu_utils.PAD_ID, torch.Generator().manual_seed(3))
    for request, completion in zip(requests, completions):
        sequence = torch.tensor([list(request.prompt_ids) + completion.token_ids])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(request.prompt_ids) - 1:-1] / 0.7
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
        assert completion.log_probs == pytest.approx(expected.tolist(), abs=1e-4)


def test_each_request_stops_at_its_own_eos_and_budget():
    model = cpu_utils.tiny_qwen2()
    requests = _requests([3, 9, 5], max_tokens=10)
    free = generate_batch(model, requests, [], cpu_utils.PAD_ID)
    eos = free[0].token_ids[2]
    stopped = generate_batch(model, requests, [eos], cpu_utils.PAD_ID)
    for before, after in zip(free, stopped):
        expected = before.token_ids[:before.token_ids.index(eos) + 1] if eos in before.token_ids else before.token_ids
        assert after.token_ids == expected and after.stopped_at_eos == (eos in before.token_ids)
    assert len(stopped[0].token_ids) <= 3 and stopped[0].stopped_at_eos
    short = generate_batch(model, [requests[0], _requests([4], max_tokens=2)[0]], [], cpu_utils.PAD_ID)
    assert [len(c.token_ids) for c in short] == [10, 2]


# ----------------------------------------------------------------------------------------------------
# the device: every tensor and the seeded generator on the trainer's device, CPU results unchanged


def test_generation_on_an_explicit_device_equals_the_models_device():
    """Seeded sampling with ``device="cpu"`` given gives exactly the tokens and log-probs of the default."""
    model = cpu_utils.tiny_qwen2()
    requests = _requests([4, 7, 2], max_tokens=6, temperature=0.9, top_k=20, top_p=0.9)
    default = generate_batch(model, requests, [], cpu_utils.PAD_ID, torch.Generator().manual_seed(5))
    explicit = generate_batch(model, requests, [], cpu_utils.PAD_ID, torch.Generator(device="cpu").manual_seed(5),
                              device="cpu")
    assert explicit == default


def test_generation_refuses_a_device_the_model_is_not_on():
    model = cpu_utils.tiny_qwen2()
    with pytest.raises(ValueError, match=r"device='meta' but the model's parameters are on cpu"):
        generate_batch(model, _requests([3]), [], cpu_utils.PAD_ID, device="meta")


def test_sampler_refuses_a_generator_of_another_device():
    """``torch.multinomial`` takes only a generator of the tensors' device; the sampler says which one to make
    (a CPU generator with CUDA logits, and a CUDA generator with CPU logits, the CUDA one faked here)."""
    logits = torch.zeros(2, 5)
    settings = (torch.ones(2), torch.full((2,), -1), torch.ones(2))
    cuda_generator = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"torch.Generator\(device='cpu'\)"):
        generation.sample_tokens(logits, *settings, generator=cuda_generator)
    with pytest.raises(ValueError, match=r"torch.Generator\(device='cuda'\)"):
        generation.check_generator_device(torch.Generator(), "cuda:0")
    generation.check_generator_device(torch.Generator(), "cpu")
    generation.check_generator_device(None, "cuda")


def test_server_device_follows_the_trainers_device_kind():
    assert rollout.server_device("cpu", replica_rank=3, device_count=0) == torch.device("cpu")
    assert rollout.server_device("cuda", replica_rank=3, device_count=2) == torch.device("cuda", 1)
    assert rollout.server_device("cuda", replica_rank=0, device_count=8) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"):
        rollout.server_device("cuda", replica_rank=0, device_count=0)
    assert rollout.visible_device_count("cpu") == 0
    assert rollout.visible_device_count("cuda") == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_server_puts_model_and_generator_on_its_device(monkeypatch):
    """The server generates on the device kind it is given; on CPU its seeded generator samples exactly what a
    default ``torch.Generator`` with the same seed samples; asking for CUDA where none is visible fails at once."""
    model = cpu_utils.tiny_qwen2()
    server = rollout.HFRolloutServer(OmegaConf.create({"prompt_length": 32, "response_length": 6, "seed": 4}),
                                     None, replica_rank=1, model=model, device_type="cpu")
    assert server.device == torch.device("cpu") and server.generator.device == torch.device("cpu")
    requests = _requests([3, 6], max_tokens=5, temperature=1.0)
    expected = generate_batch(model, requests, server.eos_token_ids, server.pad_token_id,
                              torch.Generator().manual_seed(5))
    assert server._generate(requests) == expected
    seen = []
    monkeypatch.setattr(rollout, "generate_batch", lambda *args, **kwargs: seen.append(kwargs["device"]) or [])
    server._generate(requests)
    assert seen == [torch.device("cpu")], "the server must hand its device to the generation"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="sees no cuda device"):
            rollout.HFRolloutServer(OmegaConf.create({}), None, model=model, device_type="cuda")


def test_replica_launches_its_server_on_the_trainers_device_kind(monkeypatch):
    """``launch_servers`` hands the server verl's device name of the launching process."""
    launched = {}

    class _Remote:
        def __init__(self, cls):
            self.cls = cls

        def options(self, **options):
            return self

        def remote(self, **kwargs):
            launched.update(kwargs)
            return SimpleNamespace(stats=SimpleNamespace(remote=lambda: asyncio.sleep(0)))

    monkeypatch.setattr(rollout.ray, "remote", _Remote)
    monkeypatch.setattr(rollout, "trainer_device_type", lambda: "cuda")
    monkeypatch.setattr(rollout.HFRolloutReplica, "max_concurrency", 8)
    replica = rollout.HFRolloutReplica.__new__(rollout.HFRolloutReplica)
    replica.replica_rank, replica.name_suffix = 0, ""
    replica.config, replica.model_config = OmegaConf.create({}), None
    asyncio.run(replica.launch_servers())
    assert launched["device_type"] == "cuda" and launched["replica_rank"] == 0


def test_resolve_max_tokens_follows_verls_vllm_server():
    assert rollout.resolve_max_tokens({}, prompt_len=40, prompt_length=64, response_length=32, max_model_len=None) == 32
    assert rollout.resolve_max_tokens({}, prompt_len=80, prompt_length=64, response_length=32, max_model_len=None) == 16
    assert rollout.resolve_max_tokens({"max_tokens": 5}, 10, 64, 32, None) == 5
    assert rollout.resolve_max_tokens({"max_new_tokens": 50}, 10, 64, 32, max_model_len=20) == 10
    with pytest.raises(ValueError, match="no room"):
        rollout.resolve_max_tokens({}, 96, 64, 32, None)


def test_sampling_params_the_rollout_cannot_apply_are_refused_or_reported(caplog):
    config = OmegaConf.create({"prompt_length": 32, "response_length": 6})
    with pytest.raises(NotImplementedError, match="repetition_penalty=1.2"):
        rollout.to_sampling_request([5, 6], {"repetition_penalty": 1.2}, config)
    with caplog.at_level(logging.WARNING, logger="verl_group_ppo.cpu"):
        request = rollout.to_sampling_request([5, 6], {"temperature": 0.5, "repetition_penalty": 1.0,
                                                       "presence_penalty_test_key": 0.3}, config)
    assert request.temperature == 0.5 and request.max_tokens == 6
    assert any("presence_penalty_test_key" in record.getMessage() for record in caplog.records)


def _server(model, **config):
    settings = {"prompt_length": 32, "response_length": 6, "seed": 0, "max_num_seqs": 64, **config}
    return rollout.HFRolloutServer(OmegaConf.create(settings), None, model=model)


def test_server_batches_concurrent_requests_into_one_generate():
    model = cpu_utils.tiny_qwen2()
    server = _server(model)
    requests = _requests([3, 9, 5, 12, 4, 6], max_tokens=6)

    async def send_all():
        return await asyncio.gather(*[
            server.generate(str(i), list(r.prompt_ids), {"temperature": 0, "top_p": 1.0, "top_k": -1,
                                                         "logprobs": i % 2 == 0})
            for i, r in enumerate(requests)])

    outputs = asyncio.run(send_all())
    assert server.batch_sizes == [6], "six concurrent requests must be generated as one batch"
    alone = generate_batch(model, requests, [cpu_utils.EOS_ID], cpu_utils.PAD_ID)
    for i, (out, expected) in enumerate(zip(outputs, alone)):
        assert out.token_ids == expected.token_ids
        assert (out.log_probs is None) == (i % 2 == 1)
        assert out.stop_reason == "completed" and out.extra_fields == {"global_steps": None}


class _SlowModel(torch.nn.Module):
    """A causal LM whose every forward takes at least ``delay_s`` (so a batch is still running when aborted)."""

    def __init__(self, model, delay_s: float):
        super().__init__()
        self.model, self.delay_s = model, delay_s
        self.generation_config, self.config = model.generation_config, model.config

    def forward(self, **kwargs):
        import time

        time.sleep(self.delay_s)
        return self.model(**kwargs)


def test_abort_stops_running_answers_waiting_and_holds_new_until_resume():
    """verl's partial rollout: abort -> running rows return their tokens so far and waiting requests return
    empty, both ``aborted``; a request sent while paused waits for resume_generation."""
    model = cpu_utils.tiny_qwen2()
    server = _server(_SlowModel(model, delay_s=0.01), response_length=40, ignore_eos=True)
    prompts = [list(r.prompt_ids) for r in _requests([3, 6, 4])]
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    async def scenario():
        running = [asyncio.create_task(server.generate(str(i), p, greedy)) for i, p in enumerate(prompts[:2])]
        while not server.batch_sizes:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(server.generate("w", prompts[2], greedy))
        await asyncio.sleep(0.05)
        report = await server.abort_all_requests()
        held = asyncio.create_task(server.generate("h", prompts[2], greedy))
        await asyncio.sleep(0.1)
        held_before_resume = held.done()
        await server.resume_generation()
        return report, await asyncio.gather(*running), await waiting, held_before_resume, await held

    report, running, waiting, held_before_resume, held = asyncio.run(scenario())
    full = generate_batch(model, _requests([3, 6, 4], max_tokens=40), [], cpu_utils.PAD_ID)
    assert report["aborted_count"] == 1 and waiting.stop_reason == "aborted" and waiting.token_ids == []
    for out, reference in zip(running, full):
        assert out.stop_reason == "aborted" and 0 < len(out.token_ids) < 40
        assert out.token_ids == reference.token_ids[:len(out.token_ids)] and len(out.log_probs) == len(out.token_ids)
    assert not held_before_resume
    assert held.stop_reason == "completed" and held.token_ids == full[2].token_ids


def test_server_weight_load_is_exact_and_complete():
    server = _server(cpu_utils.tiny_qwen2(seed=0))
    source = cpu_utils.tiny_qwen2(seed=1)
    named = dict(source.named_parameters())
    names = sorted(named)

    async def sync(parts):
        for i, part in enumerate(parts):
            await server.load_weights({n: named[n].detach() for n in part}, global_steps=7, last=i == len(parts) - 1)

    asyncio.run(sync([names[:5], names[5:]]))
    target = server.model.state_dict()
    assert all(torch.equal(target[n], named[n]) for n in names) and server.global_steps == 7
    with pytest.raises(ValueError, match="sent no tensor"):
        asyncio.run(sync([names[1:]]))
    with pytest.raises(KeyError, match="does not have"):
        asyncio.run(server.load_weights({"model.no_such.weight": torch.zeros(1)}))


def test_tied_embeddings_count_as_synced_through_either_name():
    model = cpu_utils.tiny_qwen2(tie_word_embeddings=True)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {"lm_head.weight"}
    assert rollout._unsynced_parameters(model, names) == set()
    assert rollout._unsynced_parameters(model, names - {"model.norm.weight"}) == {"model.norm.weight"}


# ==================================================================================================
# weight sync through Ray, as in a run


@pytest.fixture(scope="module")
def local_ray():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.slow
def test_adapter_weight_sync_after_an_actor_update_is_exact(local_ray, tmp_path):
    """An actor takes an optimizer step; the adapter (as in the actor worker) sends its weights in several
    buckets to the replica's named server actor; the server's weights then equal the actor's exactly."""
    from verl.workers.config import RolloutConfig

    actor = cpu_utils.save_tiny_qwen2(str(tmp_path))
    model_config = OmegaConf.create({"path": str(tmp_path), "override_config": {"attn_implementation": "sdpa"}})
    config = OmegaConf.create({"prompt_length": 32, "response_length": 4, "seed": 0, "max_num_seqs": 16})
    server = local_ray.remote(rollout.HFRolloutServer).options(name=rollout.server_actor_name(0), num_cpus=0).remote(
        config=config, model_config=model_config)
    before = local_ray.get(server.state_dict.remote())
    actor.train()
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    tokens = torch.tensor([[2, 3, 4, 5, 6, 7]])
    actor(tokens, labels=tokens).loss.backward()
    optimizer.step()

    adapter = rollout.HFRolloutAdapter(RolloutConfig(name="hf", tensor_model_parallel_size=1), None, None)
    assert adapter.is_leader_rank and adapter.replica_rank == 0
    adapter.bucket_bytes = 20_000  # several buckets
    asyncio.run(adapter.update_weights(iter(list(actor.named_parameters())), global_steps=3))
    served = local_ray.get(server.state_dict.remote())
    expected = actor.state_dict()
    assert any(not torch.equal(before[n], expected[n]) for n in expected), "the update changed nothing"
    assert served.keys() == expected.keys()
    assert all(torch.equal(served[n], expected[n]) for n in expected)
    assert local_ray.get(server.stats.remote())["global_steps"] == 3
    local_ray.kill(server)


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


# ==================================================================================================
# sampler.py: verl's replay buffer with a short poll interval


def _sampler_kwargs(mode: str, sampler_kwargs=None) -> dict:
    return dict(trainer_mode=mode, trainer_config=OmegaConf.create({}), max_off_policy_threshold=None,
                max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create(sampler_kwargs or {}),
                refill_fn=lambda n: None)


@pytest.mark.parametrize("mode, expected", [("sync", "ReplayBuffer"), ("colocate_async", "ReplayBufferAsync"),
                                            ("separate_async", "ReplayBufferAsync")])
def test_replay_buffer_is_verls_own_for_the_mode_with_a_short_poll(mode, expected):
    from verl_group_ppo.cpu import sampler

    buffer = sampler.replay_buffer(**_sampler_kwargs(mode))
    assert type(buffer).__name__ == expected and type(buffer).__module__ == "verl.trainer.ppo.v1.replay_buffer"
    assert buffer.poll_interval == sampler.DEFAULT_POLL_INTERVAL_S == 0.2
    assert buffer.trainer_mode == mode and buffer.refill_fn is not None


def test_replay_buffer_poll_interval_from_sampler_kwargs():
    from verl_group_ppo.cpu import sampler

    assert sampler.replay_buffer(**_sampler_kwargs("sync", {"poll_interval": 0.5})).poll_interval == 0.5
    assert sampler.replay_buffer(**_sampler_kwargs("sync", {"poll_interval": 1})).poll_interval == 1.0


@pytest.mark.parametrize("bad", [0, -1.0, "fast", True, None])
def test_replay_buffer_rejects_a_bad_poll_interval(bad):
    from verl_group_ppo.cpu import sampler

    with pytest.raises(ValueError, match="sampler_kwargs.poll_interval"):
        sampler.replay_buffer(**_sampler_kwargs("sync", {"poll_interval": bad}))


def test_replay_buffer_needs_the_trainer_mode():
    from verl_group_ppo.cpu import sampler

    kwargs = _sampler_kwargs("sync")
    del kwargs["trainer_mode"]
    with pytest.raises(TypeError, match="trainer_mode"):
        sampler.replay_buffer(**kwargs)
