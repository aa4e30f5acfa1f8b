"""Rank invariance: verl's own critic update (TrainingWorker + FSDP engine, gloo on CPU) with GROUP-PPO's
boundary critic loss gives the same parameters at 1 and 2 data-parallel ranks.

One fixed batch (uneven lengths, a hole, GROUP-PPO's boundary weights from the advantage step over the whole
batch) goes through ``train_mini_batch`` as the v1 trainer calls it; the optimizer is plain SGD without
gradient clipping so that the parameter update is the gradient itself (Adam's first step and clipping would
hide a wrong loss scale). The updates at 1 and 2 ranks must agree to 1e-5 relative.
"""

from __future__ import annotations

import functools

import pytest
import torch

import verl_group_ppo_testutils_cpu as C
import verl_group_ppo_testutils_integration as U
import verl_group_ppo_testutils_ranks as R

from verl_group_ppo.core_algos import boundary_loss_weights, compute_group_advantage, compute_group_ppo_outputs
from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.integration.critic_loss import CRITIC_WEIGHTS_KEY, make_critic_loss_fn

pytestmark = pytest.mark.slow

RTOL = 1e-5
N_PROMPTS, N_PER_PROMPT = 2, 2  # 4 responses: 2 per rank at dp 2
MICRO = 1  # padded micro-batches of one response per rank
TOKEN_BUDGET = 24  # use_dynamic_bsz: tokens per micro-batch per rank


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """A tiny Qwen2 policy and its critic (the same trunk and a saved value head), so no rank initialises a
    weight at random."""
    from transformers import Qwen2ForTokenClassification

    policy_dir, critic_dir = (str(tmp_path_factory.mktemp(name)) for name in ("policy", "critic"))
    policy = C.save_tiny_qwen2(policy_dir, seed=0)
    config = {k: v for k, v in policy.config.to_dict().items() if k not in ("id2label", "label2id")}
    torch.manual_seed(1)
    critic = Qwen2ForTokenClassification(policy.config.__class__(**config, num_labels=1))
    critic.model.load_state_dict(policy.model.state_dict())
    critic.save_pretrained(critic_dir)
    return {"policy": policy_dir, "critic": critic_dir}


def _critic_overrides(model_dir: str, strategy: str, dynamic: bool, rmpad: bool) -> list[str]:
    """verl 0.9.1's v1 trainer builds the critic's engine from ``critic.fsdp`` (``use_dynamic_bsz`` True by
    default) with ``critic.ppo_infer_max_token_len_per_gpu`` as its token budget; ``critic.use_dynamic_bsz`` and
    ``critic.ppo_micro_batch_size_per_gpu`` do not reach it. So padded micro-batches are set on ``critic.fsdp``."""
    micro = [f"critic.use_dynamic_bsz={dynamic}", f"+critic.ppo_infer_max_token_len_per_gpu={TOKEN_BUDGET}"]
    if not dynamic:
        micro += ["++critic.fsdp.use_dynamic_bsz=False", f"++critic.fsdp.micro_batch_size_per_gpu={MICRO}",
                  f"critic.ppo_micro_batch_size_per_gpu={MICRO}"]
    return [f"critic.model.path={model_dir}", "++critic.model.load_tokenizer=False",
            "+critic.model.override_config.attn_implementation=sdpa",
            f"critic.model.use_remove_padding={rmpad}", "critic.model.enable_gradient_checkpointing=False",
            f"critic.strategy={strategy}", "++critic.fsdp.mixed_precision.param_dtype=fp32",
            "critic.fsdp.use_torch_compile=False", "critic.optim.optimizer=SGD", "critic.optim.lr=1.0",
            "critic.optim.weight_decay=0.0", "critic.optim.clip_grad=1e9", *micro]


def critic_worker_config(model_dir: str, strategy: str, dynamic: bool, rmpad: bool):
    """The critic's TrainingWorkerConfig exactly as verl's v1 trainer builds it (trainer_base._init_workers)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig

    cfg = U.compose_config(_critic_overrides(model_dir, strategy, dynamic, rmpad))
    critic = omega_conf_to_dataclass(cfg.critic)
    critic.engine.infer_max_token_len_per_gpu = critic.ppo_infer_max_token_len_per_gpu
    critic.engine.max_token_len_per_gpu = critic.ppo_infer_max_token_len_per_gpu
    worker = TrainingWorkerConfig(model_type="value_model", model_config=critic.model, engine_config=critic.engine,
                                  optimizer_config=critic.optim, checkpoint_config=critic.checkpoint)
    return worker, cfg


def _rows(seed: int) -> list[dict]:
    """Per-response fields (uneven lengths, a hole in ``response_mask``), tokens inside the tiny vocabulary."""
    samples = U.make_samples(N_PROMPTS, N_PER_PROMPT, max_response=12, seed=seed, with_padding_row=False)
    return [{"prompts": s["prompts"] % C.VOCAB, "responses": s["responses"] % C.VOCAB,
             "response_mask": s["response_mask"], "loss_mask": s["loss_mask"], "values": s["values"],
             "old_log_probs": s["old_log_probs"], "rm_scores": s["rm_scores"], "uid": s["uid"]} for s in samples]


def _worker_batch(rows: list[dict], per_token: dict[str, torch.Tensor]):
    """The batch as the worker receives it (verl's no-padding layout: nested per response), with the (B, T)
    ``per_token`` fields cut to each response's length."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    out = []
    for i, row in enumerate(rows):
        n = len(row["responses"])
        seq = torch.cat([row["prompts"], row["responses"]])
        out.append({**{k: v for k, v in row.items() if k not in ("uid", "rm_scores")}, "input_ids": seq,
                    "position_ids": torch.arange(len(seq)),
                    **{k: v[i, :n].float() for k, v in per_token.items()}})
    return list_of_dict_to_tensordict(out)


def _padded(rows: list[dict]):
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    return list_of_dict_to_tensordict(rows).to_padded_tensor()


def critic_batch(seed: int = 0):
    """Critic fields: returns and GROUP-PPO's boundary weights from the advantage step over the whole batch."""
    rows = _rows(seed)
    padded = _padded(rows)
    out = compute_group_ppo_outputs(padded["rm_scores"], padded["response_mask"], values=padded["values"],
                                    settings=read_algorithm_settings(None), index=[r["uid"] for r in rows])
    weights = boundary_loss_weights(out.critic_mask, padded["loss_mask"])
    return _worker_batch(rows, {"returns": out.returns, CRITIC_WEIGHTS_KEY: weights})


def actor_batch(seed: int = 0):
    """Actor fields: GROUP-PPO's group-broadcast advantages (compute_group_advantage over the whole batch)."""
    rows = _rows(seed)
    padded = _padded(rows)
    advantages, _ = compute_group_advantage(padded["rm_scores"], padded["response_mask"], values=padded["values"],
                                            index=[r["uid"] for r in rows])
    return _worker_batch(rows, {"advantages": advantages})


def _actor_overrides(model_dir: str, strategy: str, dynamic: bool, rmpad: bool) -> list[str]:
    pre = "actor_rollout_ref"
    return [f"{pre}.model.path={model_dir}", f"++{pre}.model.load_tokenizer=False",
            f"+{pre}.model.override_config.attn_implementation=sdpa", f"{pre}.model.use_remove_padding={rmpad}",
            f"{pre}.model.enable_gradient_checkpointing=False", f"{pre}.actor.strategy={strategy}",
            f"++{pre}.actor.fsdp_config.mixed_precision.param_dtype=fp32", f"{pre}.actor.optim.optimizer=SGD",
            f"{pre}.actor.optim.lr=1.0", f"{pre}.actor.optim.weight_decay=0.0", f"{pre}.actor.optim.clip_grad=1e9",
            f"{pre}.actor.ppo_micro_batch_size_per_gpu={MICRO}", f"{pre}.actor.use_dynamic_bsz={dynamic}",
            f"{pre}.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}", f"{pre}.actor.use_kl_loss=False",
            f"{pre}.actor.entropy_coeff=0.0"]


def actor_worker_config(model_dir: str, strategy: str, dynamic: bool, rmpad: bool):
    """The actor's TrainingWorkerConfig and ``ppo_loss`` exactly as verl's ActorRolloutRefWorker.init_model builds
    them."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = U.compose_config(_actor_overrides(model_dir, strategy, dynamic, rmpad))
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.model_config = model_config
    worker = TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                  engine_config=actor.engine, optimizer_config=actor.optim,
                                  checkpoint_config=actor.checkpoint)
    worker.engine_config.use_dynamic_bsz = actor.use_dynamic_bsz
    worker.engine_config.max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    worker.engine_config.micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    worker.engine_config.use_remove_padding = rmpad
    return worker, functools.partial(ppo_loss, config=actor)


def _spec(worker, loss_fn, batch) -> dict:
    """One case for :func:`R.run_updates`: ``batch`` trained as one mini-batch."""
    n = batch.batch_size[0]
    extra = dict(global_batch_size=n, mini_batch_size=n, epochs=1, seed=1, dataloader_kwargs={"shuffle": False},
                 temperature=1.0)
    return dict(worker_config=worker, loss_fn=loss_fn, batch=batch, extra=extra)


def _compared_updates(results: list[dict], label: str) -> float:
    """The max relative difference between the updates at 1 and at 2 ranks (``results`` in that order)."""
    start = _max_rel_diff(results[0]["before"], results[1]["before"])
    assert start == 0.0, f"the ranks must start from the checkpoint's weights (max relative difference {start:.2e})"
    up1, up2 = (_updates(result) for result in results)
    assert max(float(v.abs().max()) for v in up1.values()) > 1e-4, "the update must move the model"
    diff = _max_rel_diff(up1, up2)
    print(f"{label}: max relative update difference {diff:.2e}")
    return diff


def _updates(result: dict) -> dict[str, torch.Tensor]:
    return {k: result["after"][k] - result["before"][k] for k in result["before"]}


def _max_rel_diff(a: dict, b: dict) -> float:
    """max |a - b| / max |a| over all parameter updates."""
    scale = max(float(v.abs().max()) for v in a.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


STRATEGIES = ["fsdp", "fsdp2"]
"""verl's two FSDP strategies: ``fsdp`` (torch FSDP1, the GPU recipes' default; on CPU ranks through
``verl_group_ppo.cpu.fsdp1``) and ``fsdp2``."""
MODES = ["padded", "dynamic_bsz", "remove_padding"]
"""padded: fixed micro-batches of MICRO responses; dynamic_bsz: TOKEN_BUDGET tokens per micro-batch;
remove_padding: use_remove_padding=True with the token budget (the recipes' setting)."""


def _mode(mode: str) -> dict[str, bool]:
    return {"dynamic": mode != "padded", "rmpad": mode == "remove_padding"}


def _check_engine(worker, mode: str) -> None:
    """The engine runs the micro-batching the case names (so a config change cannot empty the test)."""
    engine = worker.engine_config
    assert engine.use_dynamic_bsz == (mode != "padded")
    if mode == "padded":
        assert engine.micro_batch_size_per_gpu == MICRO
    else:
        assert engine.max_token_len_per_gpu == TOKEN_BUDGET


def _case(role: str, strategy: str, mode: str) -> str:
    return f"{role}-{strategy}-{mode}"


@pytest.fixture(scope="module")
def updates(model_dirs) -> dict[str, tuple]:
    """Every case (critic and actor, each strategy and mode) trained at 1 and at 2 ranks in one launch of each
    world size; per case, the worker config it ran and the two results."""
    workers, specs = {}, {}
    for strategy in STRATEGIES:
        for mode in MODES:
            worker, cfg = critic_worker_config(model_dirs["critic"], strategy, **_mode(mode))
            name = _case("critic", strategy, mode)
            workers[name] = worker
            specs[name] = _spec(worker, make_critic_loss_fn(cfg.critic, "boundaries"), critic_batch())
            worker, loss_fn = actor_worker_config(model_dirs["policy"], strategy, **_mode(mode))
            name = _case("actor", strategy, mode)
            workers[name] = worker
            specs[name] = _spec(worker, loss_fn, actor_batch())
    results = R.run_updates(specs, (1, 2))
    return {name: (workers[name], results[name]) for name in specs}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_critic_update_rank_invariant(updates, strategy, mode):
    worker, results = updates[_case("critic", strategy, mode)]
    _check_engine(worker, mode)
    assert _compared_updates(results, f"critic {strategy} {mode}") <= RTOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_actor_update_rank_invariant(updates, strategy, mode):
    worker, results = updates[_case("actor", strategy, mode)]
    _check_engine(worker, mode)
    assert _compared_updates(results, f"actor {strategy} {mode}") <= RTOL


# --------------------------------------------------------------------------------------------------
# item 2: the advantage step runs in the driver over the whole batch, whatever the dp size


def _half_outputs(meta, settings, threshold: float) -> list:
    """What a per-rank advantage step would compute: the core on each contiguous share verl's dispatch
    (``BatchData(meta).chunk(2)``) sends a rank."""
    from types import SimpleNamespace

    from verl.protocol import BatchData

    sizes = [len(chunk.global_indexes) for chunk in BatchData(meta).chunk(2)]
    halves, start = [], 0
    for size in sizes:
        half = SimpleNamespace(keys=list(meta.keys[start:start + size]), partition_id=meta.partition_id)
        start += size
        stored = U.get_padded(half, ["response_mask", "values", "rm_scores"])
        index = [key.split("_")[0] for key in half.keys]
        halves.append(compute_group_ppo_outputs(stored["rm_scores"], stored["response_mask"],
                                                values=stored["values"], settings=settings, index=index,
                                                threshold=threshold))
    return halves


@pytest.mark.parametrize("adv_norm", ["batch", "prompt"])
def test_advantage_step_rank_invariant_over_the_whole_batch_at_dp2(ray_tq, adv_norm):
    """With 2 ranks per node (dp 2), the stored advantages, returns, critic weights, the next threshold and the
    group/* metrics are the core's over all responses; a per-half (per-rank) computation gives other ones."""
    from verl_group_ppo.core_algos import AdaptiveThreshold

    trainer = U.make_trainer(["trainer.n_gpus_per_node=2", f"++algorithm.group_params.adv_norm={adv_norm}",
                              "++algorithm.group_params.threshold_lr=0.5",
                              "++algorithm.group_params.adaptive_target=group_size",
                              "++algorithm.group_params.target_group_size=2"])
    assert trainer.config.trainer.n_gpus_per_node == 2
    settings = read_algorithm_settings(trainer.config.algorithm)
    metrics: dict = {}
    meta = trainer._compute_advantage(U.put_samples(U.make_samples(n_prompts=4, n_per_prompt=2, seed=11)), metrics)

    stored = U.get_padded(meta, ["response_mask", "values", "rm_scores", "loss_mask", "advantages", "returns",
                                 CRITIC_WEIGHTS_KEY])
    index = [key.split("_")[0] for key in meta.keys]
    whole = compute_group_ppo_outputs(stored["rm_scores"], stored["response_mask"], values=stored["values"],
                                      settings=settings, index=index, threshold=1.0)
    threshold = AdaptiveThreshold(settings.group)
    threshold.update(whole)
    assert torch.equal(stored["advantages"], whole.advantages)
    assert torch.equal(stored["returns"], whole.returns)
    assert torch.equal(stored[CRITIC_WEIGHTS_KEY], boundary_loss_weights(whole.critic_mask, stored["loss_mask"]))
    assert {k: metrics[k] for k in whole.metrics} == whole.metrics
    assert trainer.group_threshold.value == threshold.value

    halves = _half_outputs(meta, settings, threshold=1.0)
    per_half_thresholds = [AdaptiveThreshold(settings.group) for _ in halves]
    for t, half in zip(per_half_thresholds, halves):
        t.update(half)
    assert any(t.value != threshold.value for t in per_half_thresholds)
    assert any(half.metrics != whole.metrics for half in halves)
    if adv_norm == "batch":  # batch statistics differ per half; prompts are never split by the dispatch here
        assert not torch.equal(torch.cat([h.advantages.flatten() for h in halves]).sort().values,
                               whole.advantages.flatten().sort().values)
