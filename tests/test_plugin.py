"""The verl integration: what ``import verl`` installs (both import orders, a Ray worker), the start-up and
launch checks, configs, and the verl contracts it relies on."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

import verl_group_ppo_testutils_integration as U

PYTHON = sys.executable
MODES = ("sync", "colocate_async", "separate_async")


def run_fresh(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (cwd outside the repo, so only the installed package counts)."""
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    env.update(env_extra or {})
    return subprocess.run([PYTHON, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd="/", timeout=300)


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------
# fresh processes


@pytest.mark.slow
def test_import_verl_installs_everything_lazily():
    out = last_json(run_fresh("""
        import json, sys
        import verl
        lazy = {m: m in sys.modules for m in ("verl.trainer.ppo.core_algos", "verl.trainer.ppo.v1",
                                              "verl_group_ppo.core_algos", "torch")}
        from verl.trainer.ppo import core_algos
        import verl.trainer.main_ppo as main_ppo
        from verl.trainer.ppo import utils
        from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base
        from verl_group_ppo.integration import estimator, failures
        print(json.dumps({
            "entry_point_loaded_by_verl": "verl_group_ppo.integration.entry_point" in sys.modules,
            "lazy_before_use": lazy,
            "estimator": core_algos.ADV_ESTIMATOR_REGISTRY.get("group_ppo") is estimator.group_ppo_estimator,
            "need_critic_main": main_ppo.need_critic is utils.need_critic,
            "need_critic_base": trainer_base.need_critic is utils.need_critic,
            "need_critic_ours": hasattr(utils.need_critic, "verl_group_ppo_original"),
            "launch_checks_ours": [hasattr(main_ppo.validate_config, "verl_group_ppo_original"),
                                   hasattr(main_ppo.run_ppo, "verl_group_ppo_original")],
            "trainers": {m: get_trainer_cls(m).__name__ for m in %r},
            "errors": [s for s, _ in failures.install_errors()],
        }))
    """ % (MODES,)))
    assert out["entry_point_loaded_by_verl"]
    # nothing heavy is imported by the plugin itself (torch comes with verl.protocol anyway)
    assert out["lazy_before_use"] == {"verl.trainer.ppo.core_algos": False, "verl.trainer.ppo.v1": False,
                                      "verl_group_ppo.core_algos": False, "torch": True}
    assert out["estimator"]
    assert out["need_critic_main"] and out["need_critic_base"] and out["need_critic_ours"]
    assert out["launch_checks_ours"] == [True, True]
    assert out["trainers"] == {"sync": "GroupPPOTrainerSync", "colocate_async": "GroupPPOTrainerColocateAsync",
                               "separate_async": "GroupPPOTrainerSeparateAsync"}
    assert out["errors"] == []


@pytest.mark.slow
def test_plugins_off_registers_nothing():
    out = last_json(run_fresh("""
        import json
        from verl.trainer.ppo import core_algos
        print(json.dumps("group_ppo" in core_algos.ADV_ESTIMATOR_REGISTRY))
    """, {"VERL_USE_EXTERNAL_PLUGINS": "none"}))
    assert out is False


@pytest.mark.slow
def test_plugin_selected_by_name_and_trainer_module_imported_first():
    # Importing our trainer module first makes it the importer of verl's v1 package: the v1 hook then
    # gets our half-imported module back, and the module installs its classes when it finishes.
    out = last_json(run_fresh("""
        import json
        import verl_group_ppo.integration.trainer as ours
        from verl.trainer.ppo import core_algos
        from verl.trainer.ppo.v1 import get_trainer_cls
        from verl_group_ppo.integration.failures import install_errors
        print(json.dumps({"estimator": "group_ppo" in core_algos.ADV_ESTIMATOR_REGISTRY,
                          "sync": get_trainer_cls("sync") is ours.GroupPPOTrainerSync,
                          "errors": [s for s, _ in install_errors()]}))
    """, {"VERL_USE_EXTERNAL_PLUGINS": "group_ppo"}))
    assert out == {"estimator": True, "sync": True, "errors": []}


@pytest.mark.slow
def test_broken_install_is_logged_and_stops_group_ppo_runs_with_the_cause():
    proc = run_fresh("""
        import json, sys
        sys.modules["verl_group_ppo.core_algos"] = None  # our math module fails to import
        from omegaconf import OmegaConf
        from verl.trainer.ppo import core_algos
        from verl.trainer.ppo.utils import need_critic
        from verl_group_ppo.integration.failures import PluginInstallError
        def cfg(est):
            return OmegaConf.create({"algorithm": {"adv_estimator": est}, "critic": {"enable": None},
                                     "trainer": {"use_v1": True}})
        result = {"gae": need_critic(cfg("gae"))}
        try:
            need_critic(cfg("group_ppo"))
        except PluginInstallError as e:
            result["error"] = str(e)
            result["cause"] = type(e.__cause__).__name__
        try:
            core_algos.get_adv_estimator_fn("group_ppo")(None, None)
        except PluginInstallError as e:
            result["estimator_cause"] = type(e.__cause__).__name__
        print(json.dumps(result))
    """)
    out = last_json(proc)
    assert out["gae"] is True
    assert out["cause"] == out["estimator_cause"] == "ModuleNotFoundError"  # the original ImportError
    assert "registering the group_ppo advantage estimator failed" in out["error"]
    assert "ERROR" in proc.stderr and "verl_group_ppo.core_algos" in proc.stderr


@pytest.mark.slow
def test_stock_entry_point_rejects_bad_group_params_before_ray_starts():
    proc = subprocess.run([PYTHON, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=group_ppo",
                           "++algorithm.group_params.group_max_size=0"],
                          capture_output=True, text=True, cwd="/", timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"})
    assert proc.returncode != 0
    assert "ValueError: algorithm.group_params.group_max_size must be an integer >= 1, got 0" in proc.stderr
    assert "ray init kwargs" not in proc.stdout  # main_ppo prints this right before ray.init


@pytest.mark.slow
def test_a_ray_worker_sees_the_estimator_and_trainers(ray_tq):
    import ray

    @ray.remote(num_cpus=0)
    def probe():
        from verl.trainer.ppo import core_algos
        from verl.trainer.ppo.utils import need_critic
        from verl.trainer.ppo.v1 import get_trainer_cls

        return ("group_ppo" in core_algos.ADV_ESTIMATOR_REGISTRY,
                hasattr(need_critic, "verl_group_ppo_original"),
                [get_trainer_cls(m).__name__ for m in MODES])

    registered, wrapped, trainers = ray.get(probe.remote(), timeout=240)
    assert registered and wrapped
    assert trainers == ["GroupPPOTrainerSync", "GroupPPOTrainerColocateAsync", "GroupPPOTrainerSeparateAsync"]


# ----------------------------------------------------------------------------------------------------
# need_critic and the start-up checks (in this process, where verl loaded the plugin)


def _need_critic():
    from verl.trainer.ppo.utils import need_critic

    return need_critic


@pytest.mark.parametrize("overrides", [
    ["algorithm.adv_estimator=gae"],
    ["algorithm.adv_estimator=grpo"],
    ["algorithm.adv_estimator=grpo", "critic.enable=true"],
    ["algorithm.adv_estimator=gae", "critic.enable=false"],
    ["algorithm.adv_estimator=rloo", "trainer.use_v1=false"],
])
def test_need_critic_unchanged_for_other_estimators(overrides):
    config = U.compose_config(overrides)
    need_critic = _need_critic()
    assert need_critic(config) == need_critic.verl_group_ppo_original(config)


@pytest.mark.parametrize("enable", ["null", "true"])
def test_need_critic_is_true_for_group_ppo(enable):
    config = U.compose_config(["algorithm.adv_estimator=group_ppo", f"critic.enable={enable}"])
    assert _need_critic()(config) is True
    assert _need_critic().verl_group_ppo_original(config) is (enable == "true")


@pytest.mark.parametrize("overrides,names", [
    (["critic.enable=false"], "critic.enable"),
    (["trainer.use_v1=false"], "trainer.use_v1"),
    (["critic.loss_agg_mode=seq-mean-token-mean"], "critic.loss_agg_mode"),
    (["++algorithm.group_params.group_max_size=0"], "algorithm.group_params.group_max_size"),
    (["++algorithm.group_params.boundary_rule=random"], "algorithm.group_params.boundary_rule"),
    (["++algorithm.group_params.min_threshold=5", "++algorithm.group_params.max_threshold=1"],
     "algorithm.group_params.min_threshold"),
    (["++algorithm.group_params.no_such_key=1"], "no_such_key"),
    (["algorithm.lam=1.5"], "algorithm.lam"),
    (["++algorithm.group_params.policy_lam=2"], "algorithm.group_params.policy_lam"),
    (["++algorithm.group_params.adaptive_target=reward"], "algorithm.group_params.adaptive_target"),
    (["++algorithm.group_params.target_group_size=0"], "algorithm.group_params.target_group_size"),
])
def test_group_ppo_startup_errors_name_the_key(overrides, names):
    config = U.compose_config(["algorithm.adv_estimator=group_ppo", *overrides])
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        _need_critic()(config)


def test_loss_agg_mode_is_free_with_all_tokens_critic_loss():
    config = U.compose_config(["algorithm.adv_estimator=group_ppo", "critic.loss_agg_mode=seq-mean-token-mean",
                               "++algorithm.group_params.critic_loss_on=all_tokens"])
    assert _need_critic()(config) is True


def test_estimator_without_values_explains_itself():
    import torch

    from verl.trainer.ppo import core_algos

    estimator = core_algos.get_adv_estimator_fn("group_ppo")
    with pytest.raises(RuntimeError, match="trainer.use_v1=true"):
        estimator(torch.zeros(2, 3), torch.ones(2, 3), config={})
    adv, ret = estimator(torch.zeros(2, 3), torch.ones(2, 3), config={}, values=torch.zeros(2, 3))
    assert adv.shape == ret.shape == (2, 3)


# ----------------------------------------------------------------------------------------------------
# configs


def test_stock_config_takes_group_params_with_double_plus():
    from verl_group_ppo.config import GroupParams, read_algorithm_settings

    config = U.compose_config(["algorithm.adv_estimator=group_ppo", "++algorithm.group_params.group_max_size=4",
                               "++algorithm.group_params.adv_norm=prompt"])
    params = read_algorithm_settings(config.algorithm).group
    assert params == GroupParams(group_max_size=4, adv_norm="prompt")
    assert _need_critic()(config) is True


def test_stock_config_refuses_plain_group_params_override():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        U.compose_config(["algorithm.adv_estimator=group_ppo", "algorithm.group_params.group_max_size=4"])


def test_shipped_config_extends_ppo_trainer_with_the_spec_defaults():
    from verl_group_ppo.config import GroupParams

    config = U.compose_config(["algorithm.group_params.group_max_size=32"], config_name="group_ppo_trainer")
    stock = U.compose_config([])
    assert config.algorithm.adv_estimator == "group_ppo"
    shipped = OmegaConf.to_container(config.algorithm.group_params)
    assert set(shipped) == set(GroupParams().to_dict())
    assert shipped["boundary_rule"] is None  # the value source's default
    assert GroupParams.from_config(shipped) == GroupParams(group_max_size=32)
    # everything else is verl's ppo_trainer
    for section in ("actor_rollout_ref", "critic", "data", "trainer", "transfer_queue"):
        assert OmegaConf.to_container(config[section]) == OmegaConf.to_container(stock[section]), section
    assert _need_critic()(config) is True


# ----------------------------------------------------------------------------------------------------
# what we rely on in verl (fails loudly when a verl release changes it; see docs/verl_integration.md)


def test_verl_contract():
    from packaging.version import Version

    import verl
    from verl.trainer.ppo import core_algos, ray_trainer, utils
    from verl.trainer.ppo.v1 import trainer_base
    from verl.workers.utils import losses
    from verl_group_ppo.integration import estimator, trainer

    assert Version("0.9.1") <= Version(verl.__version__) < Version("0.10"), verl.__version__
    # plugins: verl loads entry points of group verl.plugins on import
    assert "verl.plugins" in inspect.getsource(verl)
    # estimators: the registry and the keyword arguments a registered estimator receives
    assert core_algos.ADV_ESTIMATOR_REGISTRY["group_ppo"] is estimator.group_ppo_estimator
    source = inspect.getsource(ray_trainer.compute_advantage)
    for needle in ('"token_level_rewards"', '"response_mask"', '"config": config', 'adv_kwargs["index"]'):
        assert needle in source, needle
    # need_critic: one function in ppo.utils, imported by name where the trainer decides
    import verl.trainer.main_ppo as main_ppo

    for module in (main_ppo, trainer_base, ray_trainer):
        assert module.need_critic is utils.need_critic, module.__name__
    # trainers: registry and the methods the mixin overrides, with the signatures it assumes
    assert set(MODES) <= set(trainer_base.TRAINER_REGISTRY)
    for mode, (verl_cls, group_cls) in trainer.TRAINER_CLASSES.items():
        assert trainer_base.TRAINER_REGISTRY[mode] is group_cls and issubclass(group_cls, verl_cls)
    signatures = {"_compute_advantage": ["self", "batch", "metrics"], "_setup": ["self"],
                  "_save_checkpoint": ["self"], "_load_checkpoint": ["self"]}
    for name, params in signatures.items():
        assert list(inspect.signature(getattr(trainer_base.PPOTrainer, name)).parameters) == params, name
    step = inspect.getsource(trainer_base.PPOTrainer._step_once)
    assert step.index("self._compute_values(") < step.index("self._compute_advantage(") \
        < step.index("self._update_critic(")
    assert inspect.getsource(trainer_base).count(".set_loss_fn(") == 1
    assert "set_loss_fn(" in inspect.getsource(trainer_base.PPOTrainer._setup)
    # critic warm-up: the actor updates from global step trainer.critic_warmup on; the advantage step always runs
    assert "if self.config.trainer.critic_warmup <= self.global_steps:" in step
    assert step.index("self._compute_advantage(") < step.index("critic_warmup")
    # the rollout dump: verl calls _log_rollout_data (while the batch is still in TransferQueue), names by step
    fit = inspect.getsource(trainer_base.PPOTrainer.fit)
    assert fit.index("self._log_rollout_data(batch") < fit.index("tq.kv_clear(")
    assert list(inspect.signature(trainer_base.PPOTrainer._log_rollout_data).parameters) == [
        "self", "batch", "timing_raw", "rollout_data_dir"]
    assert 'f"{global_steps}.jsonl"' in inspect.getsource(trainer_base.PPOTrainer._write_generations)
    # launch checks: main_ppo calls need_critic, then validate_config (imported by name), then run_ppo
    from verl.utils import config as verl_config

    assert main_ppo.validate_config is verl_config.validate_config
    main_source = inspect.getsource(main_ppo.main)
    assert main_source.index("need_critic(config)") < main_source.index("run_ppo(")
    assert main_source.index("validate_config(") < main_source.index("run_ppo(")
    assert list(inspect.signature(main_ppo.run_ppo.verl_group_ppo_original).parameters) == [
        "config", "task_runner_class"]
    save = inspect.getsource(trainer_base.PPOTrainer._save_checkpoint)
    assert 'f"global_step_{self.global_steps}"' in save and "latest_checkpointed_iteration.txt" in save
    # the critic loss: verl's signature and the value loss we call with weights as the mask
    assert list(inspect.signature(losses.value_loss).parameters) == ["config", "model_output", "data", "dp_group"]
    assert {"vpreds", "returns", "values", "response_mask", "cliprange_value", "loss_agg_mode", "dp_size",
            "batch_num_tokens", "global_batch_size"} <= set(inspect.signature(core_algos.compute_value_loss).parameters)


def test_install_trainers_refuses_a_foreign_registry_entry():
    from verl_group_ppo.integration.trainer import TRAINER_CLASSES, install_trainers

    class Foreign:
        pass

    registry = {mode: verl_cls for mode, (verl_cls, _) in TRAINER_CLASSES.items()}
    registry["colocate_async"] = Foreign
    with pytest.raises(RuntimeError, match="'colocate_async' holds"):
        install_trainers(registry)
    assert registry["sync"] is TRAINER_CLASSES["sync"][1]  # the others are still installed
    assert registry["colocate_async"] is Foreign


def test_post_import_hooks_run_once_after_the_module_and_leave_its_loader_alone(tmp_path, monkeypatch):
    from verl_group_ppo.integration import failures, hooks as H

    (tmp_path / "gp_hook_probe_a.py").write_text("VALUE = 1\n")
    (tmp_path / "gp_hook_probe_b.py").write_text("raise_me = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks = H.PostImportHooks()
    seen = []
    hooks.add("gp_hook_probe_a", lambda m: seen.append(("a", m.VALUE)))
    hooks.add("gp_hook_probe_b", failures.guarded("probe step", lambda m: 1 / 0))
    assert hooks in sys.meta_path
    try:
        import gp_hook_probe_a  # noqa: F401
        import gp_hook_probe_b  # noqa: F401 - a failing hook must not break the import

        assert seen == [("a", 1)]
        assert type(gp_hook_probe_a.__loader__).__name__ == "SourceFileLoader"
        assert hooks not in sys.meta_path  # removed once every hook has fired
        assert failures.install_errors()[-1][0] == "probe step"
        hooks.add("gp_hook_probe_a", lambda m: seen.append(("again", m.VALUE)))  # already imported: runs now
        assert seen[-1] == ("again", 1)
    finally:
        failures._install_errors[:] = [e for e in failures._install_errors if e[0] != "probe step"]
        for name in ("gp_hook_probe_a", "gp_hook_probe_b"):
            sys.modules.pop(name, None)
        if hooks in sys.meta_path:
            sys.meta_path.remove(hooks)


# ----------------------------------------------------------------------------------------------------
# the entry point


def test_pyproject_names_the_entry_point():
    import importlib
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["verl.plugins"]["group_ppo"]
    assert target == "verl_group_ppo.integration.entry_point"
    assert importlib.import_module(target).INSTALLS


# ----------------------------------------------------------------------------------------------------
# launch checks: refused before Ray starts


SITE_PACKAGES = os.path.dirname(os.path.dirname(inspect.getfile(inspect)))


def run_entry_point(module: str, *overrides: str, env_extra: dict | None = None,
                    cwd: str = "/") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "VERL_PLATFORM")}
    env.update(env_extra or {})
    return subprocess.run([PYTHON, "-m", module, *overrides], capture_output=True, text=True, cwd=cwd,
                          timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("module,name", [
    ("verl.experimental.fully_async_policy.fully_async_main", "fully_async_policy"),
    ("verl.experimental.one_step_off_policy.main_ppo", "one_step_off_policy"),
])
def test_experimental_entry_points_are_refused_before_ray_starts(module, name):
    import verl

    # their configs find verl's ppo_trainer through a search path relative to the working directory
    proc = run_entry_point(module, "algorithm.adv_estimator=group_ppo",
                           cwd=os.path.dirname(os.path.dirname(verl.__file__)))
    assert proc.returncode != 0
    assert f"ValueError: algorithm.adv_estimator=group_ppo is not supported by verl's {name} entry point" \
        in proc.stderr, proc.stderr[-3000:]
    assert "python -m verl.trainer.main_ppo" in proc.stderr
    assert "ray init kwargs" not in proc.stdout  # run_ppo prints this right before ray.init


def test_entry_point_check_finds_the_module_of_a_ray_actor_class():
    import ray

    from verl_group_ppo.integration.startup import check_entry_point

    runner = type("FullyAsyncTaskRunner", (), {"__module__": "verl.experimental.fully_async_policy.fully_async_main"})
    with pytest.raises(ValueError, match="fully_async_policy entry point"):
        check_entry_point(ray.remote(num_cpus=0)(runner))
    from verl.trainer.main_ppo import TaskRunnerV1

    check_entry_point(TaskRunnerV1)  # verl's own entry point passes


def test_run_ppo_wrapper_refuses_only_group_ppo_on_experimental_entry_points():
    from verl_group_ppo.integration.startup import make_run_ppo

    calls = []
    run_ppo = make_run_ppo(lambda config, task_runner_class: calls.append(task_runner_class))
    runner = type("OneStepTaskRunner", (), {"__module__": "verl.experimental.one_step_off_policy.main_ppo"})
    run_ppo({"algorithm": {"adv_estimator": "gae"}}, task_runner_class=runner)
    run_ppo({"algorithm": {"adv_estimator": "group_ppo"}}, type("Ours", (), {}))
    with pytest.raises(ValueError, match="one_step_off_policy"):
        run_ppo({"algorithm": {"adv_estimator": "group_ppo"}}, runner)
    assert len(calls) == 2


def _accelerator_visible() -> bool:
    from verl.utils.device import is_device_available

    return bool(is_device_available())


@pytest.mark.slow
def test_no_accelerator_and_no_cpu_backend_is_refused_before_ray_starts():
    if _accelerator_visible():
        pytest.skip("this machine has an accelerator")
    proc = run_entry_point("verl.trainer.main_ppo", "algorithm.adv_estimator=group_ppo")
    assert proc.returncode != 0
    assert "RuntimeError: algorithm.adv_estimator=group_ppo: this machine has no accelerator visible to verl" \
        in proc.stderr, proc.stderr[-3000:]
    assert "VERL_PLATFORM=cpu (see docs/cpu.md)" in proc.stderr
    assert "ray init kwargs" not in proc.stdout


@pytest.mark.parametrize("environ,config,visible,refused", [
    ({}, {}, False, True),
    ({"VERL_PLATFORM": "cpu"}, {}, False, False),
    ({"VERL_PLATFORM": " CPU "}, {}, False, False),
    ({"VERL_PLATFORM": "nvidia"}, {}, False, True),
    ({"RAY_ADDRESS": "10.0.0.1:6379"}, {}, False, False),
    ({}, {"ray_kwargs": {"ray_init": {"address": "auto"}}}, False, False),
    ({}, {}, True, False),
])
def test_accelerator_check(environ, config, visible, refused):
    from verl_group_ppo.cpu.checks import check_accelerator

    if refused:
        with pytest.raises(RuntimeError, match="VERL_PLATFORM=cpu"):
            check_accelerator(config, environ=environ, accelerator_visible=lambda: visible)
    else:
        check_accelerator(config, environ=environ, accelerator_visible=lambda: visible)


def test_the_ray_address_override_the_refusal_names_composes_with_verls_config():
    import re

    from hydra.errors import ConfigCompositionException

    from verl_group_ppo.cpu.checks import check_accelerator

    with pytest.raises(RuntimeError) as refused:
        check_accelerator(U.compose_config(), environ={}, accelerator_visible=lambda: False)
    override = re.search(r"(\S*ray_kwargs\S*)=HOST:PORT", str(refused.value)).group(1) + "=10.0.0.1:6379"
    cfg = U.compose_config(["algorithm.adv_estimator=group_ppo", override])
    assert cfg.ray_kwargs.ray_init.address == "10.0.0.1:6379"
    check_accelerator(cfg, environ={}, accelerator_visible=lambda: False)  # joins the cluster: passes
    with pytest.raises(ConfigCompositionException):  # verl's config has no such key: the '+' is needed
        U.compose_config([override.lstrip("+")])


def test_validate_config_wrapper_checks_group_ppo_only_before_ray(monkeypatch):
    from verl_group_ppo.integration import startup

    seen = []
    monkeypatch.setattr(startup, "check_accelerator", lambda config: seen.append("checked"))
    validate_config = startup.make_validate_config(lambda config, **kwargs: seen.append(kwargs["use_critic"]))
    monkeypatch.setattr(startup, "_ray_started", lambda: False)
    sdpa = {"model": {"override_config": {"attn_implementation": "sdpa"}}}
    validate_config(config={"algorithm": {"adv_estimator": "gae"}, "critic": sdpa}, use_critic=1)
    validate_config(config={"algorithm": {"adv_estimator": "group_ppo"}, "critic": sdpa}, use_critic=2)
    monkeypatch.setattr(startup, "_ray_started", lambda: True)  # inside Ray (a TaskRunner): nothing to say
    validate_config({"algorithm": {"adv_estimator": "group_ppo"}}, use_critic=3)
    assert seen == [1, "checked", 2, 3]


@pytest.mark.parametrize("estimator", ["gae", "group_ppo"])
def test_validate_config_names_the_attention_override_when_the_critic_would_need_flash_attn(monkeypatch, estimator):
    """verl's critic asks for flash_attention_2 unless told otherwise; without flash_attn the start-up check
    names the override before Ray starts, for any run that trains a critic, and says nothing without one."""
    from verl_group_ppo.cpu import valuehead
    from verl_group_ppo.integration import startup

    monkeypatch.setattr(startup, "check_accelerator", lambda config: None)
    monkeypatch.setattr(startup, "_ray_started", lambda: False)
    monkeypatch.setattr(valuehead, "flash_attn_installed", lambda: False)
    validate_config = startup.make_validate_config(lambda config, **kwargs: "verl ran")
    config = {"algorithm": {"adv_estimator": estimator}}
    with pytest.raises(ValueError, match=r"\+critic\.model\.override_config\.attn_implementation=sdpa"):
        validate_config(config=config, use_reference_policy=False, use_critic=True)
    assert validate_config(config=config, use_reference_policy=False, use_critic=False) == "verl ran"
    config["critic"] = {"model": {"override_config": {"attn_implementation": "sdpa"}}}
    assert validate_config(config=config, use_reference_policy=False, use_critic=True) == "verl ran"


def _rows(path, sources):
    import pandas as pd

    pd.DataFrame({"data_source": sources, "prompt": ["x"] * len(sources)}).to_parquet(path)
    return str(path)


def test_validate_config_stops_a_run_whose_scorer_cannot_import_naming_the_extra(monkeypatch, tmp_path):
    """verl's reward loop turns a scorer's ImportError into a score of 0 per response; the start-up check imports
    what the rows' scorers need first, for any estimator, and names the extra that installs it."""
    import importlib

    from verl_group_ppo.tasks import reward
    from verl_group_ppo.integration import startup
    from verl_group_ppo.tasks.maths.task import ARITH_DATA_SOURCES
    from verl_group_ppo.tasks.tiny.reward import DATA_SOURCES as TINY

    monkeypatch.setattr(startup, "check_accelerator", lambda config: None)
    monkeypatch.setattr(startup, "_ray_started", lambda: False)
    validate_config = startup.make_validate_config(lambda config, **kwargs: "verl ran")
    tiny, arith = sorted(TINY)[0], sorted(ARITH_DATA_SOURCES)[0]
    real_import = importlib.import_module

    def no_reasoning_gym(name, *args):
        if name.startswith("reasoning_gym"):
            raise ModuleNotFoundError("No module named 'reasoning_gym'")
        return real_import(name, *args)

    monkeypatch.setattr(reward.importlib, "import_module", no_reasoning_gym)

    def config(train, val, path=reward.REWARD_PATH):
        return {"algorithm": {"adv_estimator": "grpo"}, "reward": {"custom_reward_function": {"path": path}},
                "data": {"train_files": train, "val_files": val}}

    tiny_rows = _rows(tmp_path / "tiny.parquet", [tiny, tiny])
    arith_rows = _rows(tmp_path / "arith.parquet", [arith])
    with pytest.raises(ImportError, match=r"reasoning_gym.*verl-group-ppo\[demo\]") as refused:
        validate_config(config=config([arith_rows], tiny_rows), use_critic=False)
    assert repr(tiny) in str(refused.value)
    assert validate_config(config=config(arith_rows, [arith_rows]), use_critic=False) == "verl ran"
    assert validate_config(config=config(tiny_rows, tiny_rows, path="my_reward.py"), use_critic=False) == "verl ran"
    with pytest.raises(ValueError, match="^data_source: 'other'"):
        validate_config(config=config(_rows(tmp_path / "other.parquet", ["other"]), []), use_critic=False)
    monkeypatch.setattr(reward.importlib, "import_module", real_import)  # installed: the tiny rows pass
    assert validate_config(config=config(tiny_rows, tiny_rows), use_critic=False) == "verl ran"


# ----------------------------------------------------------------------------------------------------
# value sources: no critic worker for mc and prefix_tree, and the start-up refusals


@pytest.mark.parametrize("source,critic", [("critic", True), ("mc", False), ("prefix_tree", False)])
def test_need_critic_follows_the_value_source(source, critic):
    config = U.compose_config(["algorithm.adv_estimator=group_ppo", "actor_rollout_ref.rollout.name=hf",
                               "actor_rollout_ref.rollout.n=4", f"++algorithm.group_params.value_source={source}"])
    assert _need_critic()(config) is critic


@pytest.mark.parametrize("overrides,names", [
    (["++algorithm.group_params.value_source=mc", "critic.enable=true"], ("critic.enable", "value_source")),
    (["++algorithm.group_params.value_source=prefix_tree", "critic.enable=true"], ("critic.enable", "value_source")),
    (["critic.enable=false"], ("critic.enable", "value_source")),
    (["++algorithm.group_params.value_source=mc", "++algorithm.group_params.boundary_rule=variance"],
     ("boundary_rule", "value_source")),
    (["++algorithm.group_params.value_source=mc", "++algorithm.group_params.mc_samples=0"], ("mc_samples",)),
    (["++algorithm.group_params.value_source=mc", "actor_rollout_ref.rollout.name=trtllm"],
     ("actor_rollout_ref.rollout.name", "value_source")),
    (["++algorithm.group_params.value_source=mc", "actor_rollout_ref.rollout.multi_turn.enable=true"],
     ("actor_rollout_ref.rollout.multi_turn.enable", "value_source")),
    (["++algorithm.group_params.value_source=mc", "trainer.v1.trainer_mode=colocate_async"],
     ("trainer.v1.trainer_mode", "value_source")),
    (["++algorithm.group_params.value_source=mc", "reward.reward_model.enable=true"],
     ("reward.reward_model.enable", "value_source")),
    (["++algorithm.group_params.value_source=mc", "reward.reward_manager.name=dapo"],
     ("reward.reward_manager.name", "value_source")),
])
def test_value_source_startup_errors_name_both_keys(overrides, names):
    config = U.compose_config(["algorithm.adv_estimator=group_ppo", "actor_rollout_ref.rollout.name=hf", *overrides])
    with pytest.raises(ValueError) as err:
        _need_critic()(config)
    for name in names:
        assert name in str(err.value), str(err.value)
