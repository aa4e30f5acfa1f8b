"""The GSM8K example scripts compose against verl's real ``ppo_trainer`` config.

Each script is run with a stub ``python3`` first on PATH that records its argv instead of training.
The recorded Hydra overrides are composed with verl's own config directory, checked with the same
``validate_config`` / ``need_critic`` / ``need_reference_policy`` calls ``verl.trainer.main_ppo``
makes before starting Ray (the model path points at a tiny local Qwen2 config + tokenizer so verl's
model config can be built offline), and GROUP-PPO's ``algorithm.group_params`` is checked with
``verl_group_ppo.config.GroupParams.from_config``. A stale or misspelled key fails composition.
The scripts must also save checkpoints and log to backends that need no account (file, TensorBoard),
with absolute output paths handed to the Ray workers.
"""

from __future__ import annotations

import importlib.util

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT_DIR = REPO / "examples" / "group_ppo_trainer"
COMMON = SCRIPT_DIR / "common.sh"
SIZES = ("0.5b", "1.5b", "3b", "7b")
ESTIMATORS = {"group_ppo": "", "gae": "_gae", "grpo": "_grpo"}
MODEL_IDS = {
    "0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "3b": "Qwen/Qwen2.5-3B-Instruct",
    "7b": "Qwen/Qwen2.5-7B-Instruct",
}
CASES = [(size, est) for size in SIZES for est in ESTIMATORS]
# group_max_size is the one GROUP-PPO key the examples set away from the package default
# (docs/configuration.md, "group_max_size"); every other key is left to GroupParams' defaults.
EXAMPLE_GROUP_MAX_SIZE = 32
GROUP_KEY = "++algorithm.group_params."
ENV_VARS = "++ray_kwargs.ray_init.runtime_env.env_vars."
# Output paths are named after the experiment, so they differ between the estimators' scripts.
RUN_PATH_KEYS = {"trainer.default_local_dir", ENV_VARS + "TENSORBOARD_DIR"}

STUB = """#!/bin/sh
# Stand-in for python3: record the arguments (NUL-separated) instead of running anything.
printf '%s\\0' "$@" > "$ARGV_FILE"
"""


def script_path(size: str, estimator: str) -> Path:
    return SCRIPT_DIR / f"run_qwen2_5-{size}_gsm8k{ESTIMATORS[estimator]}.sh"


@pytest.fixture(scope="module")
def stub_bin(tmp_path_factory) -> Path:
    bindir = tmp_path_factory.mktemp("stub_bin")
    stub = bindir / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return bindir


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A local Qwen2 config + word-level tokenizer: enough for verl's HFModelConfig, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    path = tmp_path_factory.mktemp("tiny_qwen2")
    vocab = {"<|endoftext|>": 0, "<unk>": 1, "the": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(path)
    Qwen2Config(
        vocab_size=len(vocab), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(path)
    return str(path)


def run_script(script: Path, stub_bin: Path, tmp_path: Path, *extra: str, env: dict | None = None):
    """Run a script with the stub python3; return (completed process, recorded argv or None)."""
    argv_file = tmp_path / "argv.bin"
    if argv_file.exists():
        argv_file.unlink()
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "DATA_DIR", "MODEL_PATH", "OUT_DIR")}
    full_env.update(PATH=f"{stub_bin}{os.pathsep}{os.environ.get('PATH', '')}", ARGV_FILE=str(argv_file))
    full_env.update(env or {})
    proc = subprocess.run(["bash", str(script), *extra], env=full_env, capture_output=True, text=True, timeout=60)
    argv = argv_file.read_bytes().decode().split("\0")[:-1] if argv_file.exists() else None
    return proc, argv


def overrides_of(script: Path, stub_bin: Path, tmp_path: Path, *extra: str, env: dict | None = None) -> list[str]:
    proc, argv = run_script(script, stub_bin, tmp_path, *extra, env=env)
    assert proc.returncode == 0, proc.stderr
    assert argv is not None and argv[:2] == ["-m", "verl.trainer.main_ppo"], argv
    return argv[2:]


def compose(overrides: list[str]):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def main_ppo_checks(cfg) -> tuple[bool, bool]:
    """What ``verl.trainer.main_ppo.main`` runs on the config before Ray starts on a GPU node; returns
    (critic, ref). ``need_critic`` is the plugin's (the group_params checks); ``validate_config`` is verl's
    own, without the plugin's accelerator check in front, which would refuse this GPU-less machine."""
    from verl.trainer import main_ppo

    use_critic = main_ppo.need_critic(cfg)
    use_ref = main_ppo.need_reference_policy(cfg)
    validate = getattr(main_ppo.validate_config, "verl_group_ppo_original", main_ppo.validate_config)
    validate(config=cfg, use_reference_policy=use_ref, use_critic=use_critic)
    return use_critic, use_ref


def multiturn_script_path(estimator: str) -> Path:
    return SCRIPT_DIR / f"run_qwen2_5-0.5b_gsm8k_multiturn{ESTIMATORS[estimator]}.sh"


def test_script_set_is_complete():
    present = {p.name for p in SCRIPT_DIR.glob("run_*.sh")}
    expected = {script_path(size, est).name for size, est in CASES}
    expected |= {multiturn_script_path(est).name for est in ESTIMATORS}
    expected |= {mc_script_path(size).name for size in SIZES}
    expected.add(TREE_SCRIPT.name)
    assert present == expected, "every example script must be covered by this test"


@pytest.mark.slow
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_multiturn_recipe_composes_with_verl_config(estimator, stub_bin, tiny_model, tmp_path):
    """The tool-calling recipe: the single-turn 0.5b recipe plus verl's tool agent loop, hermes format and the
    calculator tool; nothing else differs."""
    from omegaconf import OmegaConf

    env = {"DATA_DIR": str(tmp_path / "gsm8k_multiturn"), "MODEL_PATH": tiny_model}
    multi = overrides_of(multiturn_script_path(estimator), stub_bin, tmp_path, env=env)
    single = overrides_of(script_path("0.5b", estimator), stub_bin, tmp_path, env=env)
    cfg = compose(multi)
    OmegaConf.to_container(cfg, resolve=True)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.multi_turn.enable and rollout.multi_turn.format == "hermes"
    assert rollout.agent.default_agent_loop == "tool_agent" and rollout.multi_turn.max_assistant_turns == 5
    assert Path(rollout.multi_turn.function_tool_path) == SCRIPT_DIR / "calculator_tool.py"
    assert cfg.trainer.experiment_name == f"qwen2_5-0.5b_gsm8k_multiturn_{estimator}"
    main_ppo_checks(cfg)
    added = [o for o in multi if o not in single]
    assert all(o.split("=")[0].startswith("actor_rollout_ref.rollout.multi_turn.") or
               o.split("=")[0] in ("actor_rollout_ref.rollout.agent.default_agent_loop", "trainer.experiment_name",
                                   "trainer.default_local_dir", ENV_VARS + "TENSORBOARD_DIR") for o in added), added


def test_multiturn_calculator_tool_loads_through_verl_and_parses_hermes_calls():
    import asyncio
    import json

    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.tool_parser import ToolParser
    from verl.tools.function_tool import load_function_tools_from_path

    tools = load_function_tools_from_path(str(SCRIPT_DIR / "calculator_tool.py"))
    assert [t.name for t in tools] == ["calculate"]
    call = lambda expr: asyncio.run(tools[0].call({"expression": expr}))  # noqa: E731
    assert call("48 / 2 + 7") == "31" and call("1,200 * 3") == "3600" and call("10 / 4") == "2.5"
    assert call("__import__('os').getcwd()").startswith("error:") and call("2 ** 1000").startswith("error:")
    assert call("1 / 0").startswith("error:")
    spec = importlib.util.spec_from_file_location("verl_group_ppo_cpu_make_qwen_standin",
                                                  REPO / "examples" / "cpu" / "make_qwen_standin.py")
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    tok = AutoTokenizer.from_pretrained(standin.tokenizer_dir())  # Qwen2.5's real tokenizer (the test extra)
    text = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "48 / 2 + 7"}}\n</tool_call>'
    _, calls = asyncio.run(ToolParser.get_tool_parser("hermes", tok).extract_tool_calls(tok.encode(text)))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("calculate", {"expression": "48 / 2 + 7"})]


@pytest.fixture(scope="module")
def composed_script(stub_bin, tiny_model, tmp_path_factory):
    """``(size, estimator) -> (config, data dir, out dir)``: the script run once with DATA_DIR, MODEL_PATH (the tiny
    model) and OUT_DIR set and its overrides composed once (hydra's composition is the slow part), shared by
    :func:`test_script_composes_with_verl_config` and :func:`test_script_saves_and_logs_without_an_account`; each
    caller gets its own copy of the config."""
    import copy

    from omegaconf import OmegaConf

    cache: dict[tuple[str, str], tuple] = {}

    def get(size: str, estimator: str):
        if (size, estimator) not in cache:
            work = tmp_path_factory.mktemp(f"{size}-{estimator}")
            data_dir, out_dir = str(work / "gsm8k"), work / "out"
            overrides = overrides_of(script_path(size, estimator), stub_bin, work,
                                     env={"DATA_DIR": data_dir, "MODEL_PATH": tiny_model, "OUT_DIR": str(out_dir)})
            cfg = compose(overrides)
            OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
            cache[(size, estimator)] = (cfg, data_dir, out_dir)
        cfg, data_dir, out_dir = cache[(size, estimator)]
        return copy.deepcopy(cfg), data_dir, out_dir

    return get


@pytest.mark.slow
@pytest.mark.parametrize("size,estimator", CASES, ids=[f"{s}-{e}" for s, e in CASES])
def test_script_composes_with_verl_config(size, estimator, composed_script, tiny_model):
    # every interpolation resolves (checked where the config is composed)
    cfg, data_dir, _ = composed_script(size, estimator)

    algo, actor, rollout = cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert algo.adv_estimator == estimator
    assert rollout.name == "vllm"
    assert rollout.n > 1
    assert cfg.data.train_files == f"{data_dir}/train.parquet"
    assert cfg.data.val_files == f"{data_dir}/test.parquet"
    assert cfg.actor_rollout_ref.model.path == tiny_model
    assert cfg.trainer.experiment_name == f"qwen2_5-{size}_gsm8k_{estimator}"
    # The model's TP degree must fit in the node.
    assert cfg.trainer.n_gpus_per_node % rollout.tensor_model_parallel_size == 0

    use_critic, use_ref = main_ppo_checks(cfg)
    if estimator == "grpo":
        assert not use_critic
        assert use_ref and actor.use_kl_loss and actor.kl_loss_coef > 0
        assert "group_params" not in algo
    else:
        assert use_critic
        assert cfg.critic.model.path == tiny_model
        assert not use_ref and not actor.use_kl_loss and not algo.use_kl_in_reward
    if estimator == "gae":
        assert "group_params" not in algo

    if estimator == "group_ppo":
        from verl_group_ppo.config import GroupParams

        # Only group_max_size is given; every other key takes GroupParams' default.
        assert set(algo.group_params) == {"group_max_size"}
        assert GroupParams.from_config(algo.group_params) == GroupParams(group_max_size=EXAMPLE_GROUP_MAX_SIZE)


@pytest.mark.slow
@pytest.mark.parametrize("size,estimator", CASES, ids=[f"{s}-{e}" for s, e in CASES])
def test_script_saves_and_logs_without_an_account(size, estimator, composed_script):
    cfg, _, out_dir = composed_script(size, estimator)
    trainer = cfg.trainer
    run_dir = f"{out_dir}/{trainer.project_name}/{trainer.experiment_name}"
    # Checkpoints: periodically (verl also saves at the last step whenever save_freq > 0), bounded on disk.
    assert 0 < trainer.save_freq < trainer.total_epochs * 7473 // cfg.data.train_batch_size
    assert trainer.max_actor_ckpt_to_keep >= 1 and trainer.max_critic_ckpt_to_keep >= 1
    assert trainer.default_local_dir == f"{run_dir}/checkpoints"
    # Logging: the console plus two backends that work offline; paths reach the workers through Ray.
    assert set(trainer.logger) == {"console", "tensorboard", "file"}
    env_vars = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env_vars.VERL_FILE_LOGGER_ROOT == str(out_dir)
    assert env_vars.TENSORBOARD_DIR == f"{run_dir}/tensorboard"


@pytest.mark.slow
def test_relative_out_dir_is_made_absolute(stub_bin, tmp_path):
    overrides = overrides_of(script_path("0.5b", "group_ppo"), stub_bin, tmp_path, env={"OUT_DIR": "runs/x"})
    root = dict(item.split("=", 1) for item in overrides)[ENV_VARS + "VERL_FILE_LOGGER_ROOT"]
    assert os.path.isabs(root) and root.endswith("/runs/x")


@pytest.mark.slow
def test_group_metrics_reach_the_file_and_tensorboard_logs(stub_bin, tmp_path, monkeypatch):
    """verl's own Tracking, built as the trainer builds it from the script's settings, keeps group/* offline."""
    import json

    from verl.utils.tracking import Tracking

    cfg = compose(overrides_of(script_path("0.5b", "group_ppo"), stub_bin, tmp_path,
                               env={"OUT_DIR": str(tmp_path / "out")}))
    for key, value in cfg.ray_kwargs.ray_init.runtime_env.env_vars.items():
        monkeypatch.setenv(key, str(value))
    tracking = Tracking(project_name=cfg.trainer.project_name, experiment_name=cfg.trainer.experiment_name,
                        default_backend=list(cfg.trainer.logger), config={})
    tracking.log({"group/threshold": 1.25, "group/mean_group_size": 11.5}, step=3)
    for backend in tracking.logger.values():
        if hasattr(backend, "finish"):
            backend.finish()
    jsonl = tmp_path / "out" / cfg.trainer.project_name / f"{cfg.trainer.experiment_name}.jsonl"
    record = json.loads(jsonl.read_text().splitlines()[-1])
    assert record == {"step": 3, "data": {"group/threshold": 1.25, "group/mean_group_size": 11.5}}
    assert list((tmp_path / "out").rglob("tensorboard/events.out.tfevents.*"))


@pytest.mark.slow
def test_wandb_is_one_override_away(stub_bin, tmp_path):
    logger = "trainer.logger=[console,tensorboard,file,wandb]"
    cfg = compose(overrides_of(script_path("0.5b", "group_ppo"), stub_bin, tmp_path, logger))
    assert list(cfg.trainer.logger) == ["console", "tensorboard", "file", "wandb"]


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_baselines_differ_only_where_the_estimator_requires(size, stub_bin, tmp_path):
    def as_dict(est):
        items = overrides_of(script_path(size, est), stub_bin, tmp_path)
        pairs = dict(item.split("=", 1) for item in items)
        assert len(pairs) == len(items), f"{est}: a key is set twice"
        return pairs

    group, gae, grpo = as_dict("group_ppo"), as_dict("gae"), as_dict("grpo")
    group_keys = {k for k in group if k.startswith(GROUP_KEY)}
    assert group_keys == {GROUP_KEY + "group_max_size"}

    def diff(a, b):
        return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}

    assert diff(group, gae) == {"algorithm.adv_estimator", "trainer.experiment_name"} | RUN_PATH_KEYS | group_keys
    assert diff(group, grpo) == RUN_PATH_KEYS | {
        "algorithm.adv_estimator",
        "trainer.experiment_name",
        "critic.enable",
        "actor_rollout_ref.actor.use_kl_loss",
        "actor_rollout_ref.actor.kl_loss_coef",
        "actor_rollout_ref.actor.kl_loss_type",
        "trainer.critic_warmup",
    } | group_keys
    assert grpo["critic.enable"] == "False" and group["critic.enable"] == "True"
    # docs/results.md, "Version 2": the same critic warm-up (20 critic-only steps) for both critic arms; GRPO
    # has no critic and trains its actor from the first step, as verl runs it
    assert group["trainer.critic_warmup"] == gae["trainer.critic_warmup"] == "21" and grpo["trainer.critic_warmup"] == "0"


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_recipes_set_only_group_params_that_differ_from_the_defaults(size, stub_bin, tmp_path):
    from verl_group_ppo.config import GroupParams

    items = overrides_of(script_path(size, "group_ppo"), stub_bin, tmp_path)
    given = dict(item[len(GROUP_KEY):].split("=", 1) for item in items if item.startswith(GROUP_KEY))
    assert given, "the group_ppo recipe sets group_max_size"
    chosen, defaults = GroupParams.from_config(given), GroupParams()
    assert [key for key in given if getattr(chosen, key) == getattr(defaults, key)] == []


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_default_model_and_data_paths(size, stub_bin, tmp_path):
    overrides = overrides_of(script_path(size, "group_ppo"), stub_bin, tmp_path, env={"HOME": str(tmp_path)})
    assert f"actor_rollout_ref.model.path={MODEL_IDS[size]}" in overrides
    assert f"critic.model.path={MODEL_IDS[size]}" in overrides
    assert f"data.train_files={tmp_path}/data/gsm8k/train.parquet" in overrides


@pytest.mark.slow
def test_extra_overrides_are_passed_through_and_win(stub_bin, tiny_model, tmp_path):
    from verl_group_ppo.config import GroupParams

    overrides = overrides_of(
        script_path("0.5b", "group_ppo"), stub_bin, tmp_path,
        "trainer.total_epochs=1", "++algorithm.group_params.group_max_size=64", "algorithm.lam=0.95",
        env={"MODEL_PATH": tiny_model},
    )
    assert overrides[-3:] == ["trainer.total_epochs=1", "++algorithm.group_params.group_max_size=64", "algorithm.lam=0.95"]
    cfg = compose(overrides)
    assert EXAMPLE_GROUP_MAX_SIZE != 64  # the override must change something
    assert cfg.trainer.total_epochs == 1
    assert cfg.algorithm.lam == 0.95
    assert GroupParams.from_config(cfg.algorithm.group_params).group_max_size == 64


@pytest.mark.slow
def test_misspelled_key_fails_composition(stub_bin, tmp_path):
    from hydra.errors import ConfigCompositionException

    overrides = overrides_of(
        script_path("0.5b", "gae"), stub_bin, tmp_path, "actor_rollout_ref.actor.ppo_mini_batch_sise=8"
    )
    with pytest.raises(ConfigCompositionException, match="ppo_mini_batch_sise"):
        compose(overrides)


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,key",
    [
        ("++algorithm.group_params.group_max_sise=8", "group_max_sise"),
        ("++algorithm.group_params.group_max_size=0", "group_max_size"),
        ("++algorithm.group_params.boundary_rule=entropy", "boundary_rule"),
    ],
)
def test_bad_group_params_are_rejected(override, key, stub_bin, tmp_path):
    from verl_group_ppo.config import GroupParams

    cfg = compose(overrides_of(script_path("0.5b", "group_ppo"), stub_bin, tmp_path, override))
    with pytest.raises(ValueError, match=key):
        GroupParams.from_config(cfg.algorithm.group_params)


@pytest.mark.slow
def test_batch_sizes_that_do_not_fit_the_gpus_fail_verl_validation(stub_bin, tiny_model, tmp_path):
    # 256 prompts x 5 responses do not split over 3 GPUs: verl's own check must catch it.
    cfg = compose(
        overrides_of(script_path("0.5b", "gae"), stub_bin, tmp_path, "trainer.n_gpus_per_node=3",
                     env={"MODEL_PATH": tiny_model})
    )
    with pytest.raises(AssertionError, match="divisible"):
        main_ppo_checks(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [((), "SIZE"), (("2b", "gae"), "unknown SIZE"), (("3b", "ppo"), "unknown ESTIMATOR")])
def test_common_rejects_bad_arguments(args, message, stub_bin, tmp_path):
    proc, argv = run_script(COMMON, stub_bin, tmp_path, *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert argv is None


def test_group_ppo_is_registered_with_the_plugin_loaded():
    import verl  # noqa: F401  (loads the verl.plugins entry points)
    from verl.trainer.ppo import core_algos

    assert "group_ppo" in core_algos.ADV_ESTIMATOR_REGISTRY


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,key",
    [
        ("++algorithm.group_params.group_max_size=0", "group_max_size"),
        ("++algorithm.group_params.min_threshold=20.0", "min_threshold"),
        ("critic.enable=False", "critic.enable"),
    ],
)
def test_plugin_startup_checks_reject_bad_group_ppo_settings(override, key, stub_bin, tiny_model, tmp_path):
    # With the plugin loaded, the checks main_ppo runs before Ray starts refuse a bad group_ppo config.
    cfg = compose(
        overrides_of(script_path("0.5b", "group_ppo"), stub_bin, tmp_path, override, env={"MODEL_PATH": tiny_model})
    )
    with pytest.raises(ValueError, match=key):
        main_ppo_checks(cfg)


# ------------------------------------------------------------------------------------------------------------------
# The CPU launcher (examples/cpu/common.sh): one list of settings that reads the task's spec

CPU_LAUNCHER = REPO / "examples" / "cpu" / "common.sh"
CPU_TASKS = [("tiny", "0"), ("tiny", "1"), ("twoway", "0"), ("arith", "0")]


def cpu_launcher_command(tmp_path: Path, task: str, multi_turn: str, estimator: str, *extra: str) -> list[list[str]]:
    """Every interpreter call the CPU launcher makes (prepare, then main_ppo), through a stub PYTHON that records
    them and runs only the task spec's ``python -m verl_group_ppo.tasks.launcher`` (the launcher reads its variables)."""
    stub, calls = stub_interpreter(tmp_path)
    env = {**os.environ, "TASK": task, "MULTI_TURN": multi_turn, "WORK_DIR": str(tmp_path / "work"),
           "PYTHON": str(stub)}
    proc = subprocess.run(["bash", str(CPU_LAUNCHER), estimator, *extra], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return recorded_calls(calls)


def stub_interpreter(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in ``PYTHON`` for the CPU launcher and the file it records into (emptied): it appends each call's
    arguments, then a ``----`` line, and runs only the task spec's ``python -m verl_group_ppo.tasks.launcher`` (the
    launcher reads its variables from it)."""
    import sys

    calls = tmp_path / "calls.txt"
    calls.unlink(missing_ok=True)
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\n[ "$2" = verl_group_ppo.tasks.launcher ] && exec {sys.executable} "$@"\n'
                    f'printf "%s\\n" "$@" ---- >> {calls}\n')
    stub.chmod(0o755)
    return stub, calls


def recorded_calls(calls: Path) -> list[list[str]]:
    """The interpreter calls :func:`stub_interpreter` recorded, in order."""
    return [call.splitlines() for call in calls.read_text().split("----\n") if call]


def hydra_key(override: str) -> str:
    """The key an override sets: ``++a.b=1``, ``+a.b=1``, ``~a.b`` and ``a.b=1`` all set ``a.b``."""
    return override.lstrip("~+").split("=", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("task,multi_turn", CPU_TASKS)
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_cpu_launcher_sets_no_key_twice_and_takes_the_numbers_from_the_spec(task, multi_turn, estimator, tmp_path):
    from verl_group_ppo.tasks.launcher import spec_for
    from verl_group_ppo.tasks.reward import REWARD_PATH as REWARD

    spec = spec_for(task, multi_turn)
    prepare, main = cpu_launcher_command(tmp_path, task, multi_turn, estimator)
    assert prepare == ["-m", spec.prepare_module, "--output-dir", str(tmp_path / "work"), *spec.prepare_args]
    assert main[:2] == ["-m", "verl.trainer.main_ppo"]
    keys = [hydra_key(o) for o in main[2:]]
    assert sorted(k for k in set(keys) if keys.count(k) > 1) == []
    given = dict(o.lstrip("+").split("=", 1) for o in main[2:])
    assert given["reward.custom_reward_function.path"] == REWARD
    assert given["trainer.experiment_name"] == f"{spec.name}_{estimator}"
    assert int(given["data.max_response_length"]) == spec.response_length
    assert int(given["data.max_prompt_length"]) == spec.prompt_length
    assert int(given["trainer.total_training_steps"]) == spec.steps
    assert int(given["critic.ppo_mini_batch_size"]) * spec.rollout_n >= spec.rank_unit
    assert float(given["actor_rollout_ref.actor.optim.lr"]) == spec.actor_lr
    assert float(given["actor_rollout_ref.rollout.temperature"]) == spec.temperature
    assert (given["trainer.val_before_train"], int(given["trainer.test_freq"])) == (str(spec.val_before_train),
                                                                                   spec.test_freq)
    assert ("actor_rollout_ref.rollout.multi_turn.enable" in given) == spec.multi_turn
    # the user's overrides come last, so they win
    _, main = cpu_launcher_command(tmp_path, task, multi_turn, estimator, "trainer.total_training_steps=2")
    assert main[-1] == "trainer.total_training_steps=2"


@pytest.mark.slow
@pytest.mark.parametrize("env,message", [({"TASK": "big"}, "TASK"), ({"TASK": "twoway", "MULTI_TURN": "1"}, "MULTI_TURN"),
                                         ({"MULTI_TURN": "2"}, "MULTI_TURN"), ({"PREPARE": "yes"}, "PREPARE")])
def test_cpu_launcher_refuses_a_task_it_does_not_know(env, message, tmp_path):
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\n[ "$2" = verl_group_ppo.tasks.launcher ] && exec "$REAL_PYTHON" "$@"\nexit 0\n')
    stub.chmod(0o755)
    import sys

    full_env = {**os.environ, "WORK_DIR": str(tmp_path / "w"), "PYTHON": str(stub), "REAL_PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", str(CPU_LAUNCHER), "gae"], env=full_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def cpu_launcher_run(tmp_path: Path, estimator: str, env: dict) -> tuple[list[str], dict[str, str]]:
    """The main_ppo argv the launcher would run, and the environment it would run it in (VERL_PLATFORM,
    thread counts), through a stub PYTHON (prepare and main_ppo only recorded)."""
    import sys

    calls, seen = tmp_path / "calls.txt", tmp_path / "env.txt"
    calls.unlink(missing_ok=True)
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\n[ "$2" = verl_group_ppo.tasks.launcher ] && exec {sys.executable} "$@"\n'
                    f'printf "%s\\n" "$@" ---- >> {calls}\n'
                    f'printf "VERL_PLATFORM=%s\\nOMP_NUM_THREADS=%s\\n" "${{VERL_PLATFORM-<unset>}}" '
                    f'"$OMP_NUM_THREADS" > {seen}\n')
    stub.chmod(0o755)
    full_env = {**os.environ, "WORK_DIR": str(tmp_path / "work"), "PYTHON": str(stub), "VERL_PLATFORM": "cpu", **env}
    full_env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(["bash", str(CPU_LAUNCHER), estimator], env=full_env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    main = [call.splitlines() for call in calls.read_text().split("----\n") if call][-1]
    assert main[:2] == ["-m", "verl.trainer.main_ppo"]
    return main[2:], dict(line.split("=", 1) for line in seen.read_text().splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("task,estimator", [("tiny", "group_ppo"), ("tiny", "gae"), ("twoway", "group_ppo"),
                                            ("arith", "group_ppo")])
def test_cpu_launcher_with_device_cuda_composes_for_gpus(task, estimator, tmp_path):
    """DEVICE=cuda: the same task and settings on verl's CUDA platform: no VERL_PLATFORM (an inherited one is
    unset), trainer.device=cuda, Ray's CPUs and the threads from the machine, sdpa for actor and critic (no
    flash-attn), the hf rollout; the command composes against verl's own config."""
    cpu_args, cpu_env = cpu_launcher_run(tmp_path, estimator, {"TASK": task, "N_RANKS": "2"})
    cuda_args, cuda_env = cpu_launcher_run(tmp_path, estimator, {"TASK": task, "DEVICE": "cuda", "N_RANKS": "2"})
    assert cpu_env["VERL_PLATFORM"] == "cpu" and cuda_env["VERL_PLATFORM"] == "<unset>"
    cores = os.cpu_count()
    assert int(cuda_env["OMP_NUM_THREADS"]) == max(1, cores // 4)
    cfg = compose(cuda_args)
    assert cfg.trainer.device == "cuda" and cfg.trainer.n_gpus_per_node == 2
    assert cfg.ray_kwargs.ray_init.num_cpus == cores and cfg.ray_kwargs.ray_init.num_gpus == 2
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.critic.model.override_config.attn_implementation == "sdpa"
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    changed = {hydra_key(o) for o in set(cuda_args) ^ set(cpu_args)}
    assert changed == {"trainer.device"} | ({"ray_kwargs.ray_init.num_cpus"} if cores != 8 else set())


@pytest.mark.slow
def test_cpu_launcher_refuses_an_unknown_device(tmp_path):
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\n[ "$2" = verl_group_ppo.tasks.launcher ] && exec "$REAL_PYTHON" "$@"\nexit 0\n')
    stub.chmod(0o755)
    import sys

    env = {**os.environ, "WORK_DIR": str(tmp_path / "w"), "PYTHON": str(stub), "REAL_PYTHON": sys.executable,
           "DEVICE": "gpu"}
    proc = subprocess.run(["bash", str(CPU_LAUNCHER), "gae"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "DEVICE='gpu' must be cpu or cuda" in proc.stderr


# ----------------------------------------------------------------------------------------------------
# the mc variant of the GSM8K recipes (value_source=mc: no critic)


def mc_script_path(size: str) -> Path:
    return SCRIPT_DIR / f"run_qwen2_5-{size}_gsm8k_mc.sh"


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_mc_recipe_composes_with_verl_config_and_runs_no_critic(size, stub_bin, tiny_model, tmp_path):
    from omegaconf import OmegaConf

    from verl_group_ppo.config import GroupParams

    env = {"DATA_DIR": str(tmp_path / "gsm8k"), "MODEL_PATH": tiny_model}
    items = overrides_of(mc_script_path(size), stub_bin, tmp_path, env=env)
    pairs = dict(item.split("=", 1) for item in items)
    assert len(pairs) == len(items), "a key is set twice"
    cfg = compose(items)
    OmegaConf.to_container(cfg, resolve=True)
    assert cfg.algorithm.adv_estimator == "group_ppo" and cfg.actor_rollout_ref.rollout.name == "vllm"
    assert cfg.trainer.experiment_name == f"qwen2_5-{size}_gsm8k_group_ppo_mc"
    params = GroupParams.from_config(cfg.algorithm.group_params)
    assert params == GroupParams(value_source="mc", mc_samples=4, group_max_size=64)
    assert params.boundary_rule == "fixed"
    use_critic, use_ref = main_ppo_checks(cfg)
    assert not use_critic and not use_ref and cfg.trainer.critic_warmup == 0

    # against the critic recipe: only the value source's keys, the critic and its warm-up, and the run's names
    group = dict(item.split("=", 1) for item in overrides_of(script_path(size, "group_ppo"), stub_bin, tmp_path,
                                                               env=env))
    differ = {k for k in pairs.keys() | group.keys() if pairs.get(k) != group.get(k)}
    assert differ == RUN_PATH_KEYS | {"trainer.experiment_name", "critic.enable", "trainer.critic_warmup"} | {
        GROUP_KEY + key for key in ("value_source", "mc_samples", "group_max_size")}


# ----------------------------------------------------------------------------------------------------
# the tree-rollout GSM8K recipe (group_ppo_tree: prefix_tree values over a tree, no critic)

TREE_SCRIPT = SCRIPT_DIR / "run_qwen2_5-0.5b_gsm8k_tree.sh"


@pytest.mark.slow
def test_tree_recipe_composes_with_verl_config_and_passes_the_tree_start_up_checks(stub_bin, tiny_model, tmp_path):
    from omegaconf import OmegaConf

    from verl_group_ppo.config import GroupParams
    from verl_group_ppo.tree.limits import check_tree_config, tree_shape, uses_tree_rollout

    env = {"DATA_DIR": str(tmp_path / "gsm8k"), "MODEL_PATH": tiny_model}
    items = overrides_of(TREE_SCRIPT, stub_bin, tmp_path, env=env)
    pairs = dict(item.split("=", 1) for item in items)
    assert len(pairs) == len(items), "a key is set twice"
    cfg = compose(items)
    OmegaConf.to_container(cfg, resolve=True)
    assert cfg.algorithm.adv_estimator == "group_ppo" and cfg.actor_rollout_ref.rollout.name == "vllm"
    assert cfg.trainer.experiment_name == "qwen2_5-0.5b_gsm8k_group_ppo_tree"
    assert uses_tree_rollout(cfg)
    shape = tree_shape(cfg)
    assert (shape.roots, shape.branching, shape.segment_tokens) == (2, (2, 2), 64)
    assert cfg.actor_rollout_ref.rollout.n == shape.size == 8
    check_tree_config(cfg)  # the start-up refusals (n against the shape, the estimator's keys) pass
    params = GroupParams.from_config(cfg.algorithm.group_params)
    assert (params.value_source, params.boundary_rule, params.policy_lam) == ("prefix_tree", "tree", 0.0)
    use_critic, use_ref = main_ppo_checks(cfg)
    assert not use_critic and not use_ref and cfg.trainer.critic_warmup == 0

    # against the critic recipe: the tree's and the value source's keys, n, the critic and its warm-up, the names
    group = dict(item.split("=", 1) for item in overrides_of(script_path("0.5b", "group_ppo"), stub_bin, tmp_path,
                                                               env=env))
    differ = {k for k in pairs.keys() | group.keys() if pairs.get(k) != group.get(k)}
    assert differ == RUN_PATH_KEYS | {"trainer.experiment_name", "critic.enable", "trainer.critic_warmup",
                                      "actor_rollout_ref.rollout.n",
                                      "actor_rollout_ref.rollout.agent.default_agent_loop"} | {
        "++tree_rollout." + key for key in ("roots", "branching", "segment_tokens")} | {
        GROUP_KEY + key for key in ("value_source", "boundary_rule", "policy_lam", "group_max_size")}


@pytest.mark.slow
@pytest.mark.parametrize("spec_name", ["bench_validation", "first_comparison", "tree_comparison", "tree_settings"])
def test_the_benchs_arms_compose_with_verls_config_and_pass_the_start_up_checks(spec_name, tiny_model, tmp_path):
    """Every arm of the bench's specs, as the comparison engine launches it (benchmarks/compare.py), through the CPU
    launcher with a stub interpreter: its main_ppo overrides compose with verl's config and pass the checks
    main_ppo runs before Ray starts; the tree arms sample 8 replies as 2 roots x [2, 2] without a critic."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import compare

    spec = compare.load_spec(compare.spec_path(spec_name))
    for arm in spec.arms:
        stub, calls = stub_interpreter(tmp_path)
        args, env = compare.command(spec, arm, 0, str(tmp_path / "ckpt"))
        assert env["WORK_DIR"].endswith("runs/regime-tiny") and env["PREPARE"] == "0"
        work = tmp_path / "work"  # the spec's prepared task, stood in for by a tiny model (a fresh clone has none)
        work.mkdir(exist_ok=True)
        if not (work / "model").exists():
            (work / "model").symlink_to(tiny_model)
        proc = subprocess.run(args, env={**os.environ, **env, "WORK_DIR": str(work), "PYTHON": str(stub)}, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{arm}: {proc.stderr}"
        main = recorded_calls(calls)[-1]
        assert main[:2] == ["-m", "verl.trainer.main_ppo"], arm
        cfg = compose(main[2:])
        critic, _ = main_ppo_checks(cfg)
        assert cfg.trainer.total_training_steps == spec.steps and cfg.actor_rollout_ref.rollout.val_kwargs.n == 8
        if env.get("ROLLOUT") == "tree":
            assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.tree_rollout.roots == 2, arm
            assert list(cfg.tree_rollout.branching) == [2, 2] and cfg.tree_rollout.segment_tokens == 4, arm
            assert cfg.tree_rollout.get("shared_prefix", "once") == ("per_leaf" if arm == "tree_per_leaf" else "once")
            if "group_params" in cfg.algorithm:
                assert cfg.algorithm.group_params.boundary_rule == "tree", arm
                assert cfg.algorithm.group_params.get("adv_norm", "batch") == (
                    "parent" if arm == "tree_parent" else "batch"), arm
        assert critic == (arm in ("group_ppo", "gae")), arm
