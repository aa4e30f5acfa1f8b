"""The GROUP-PPO trainer mixin on a real TransferQueue: advantage step, critic fields, threshold, checkpoints.

The trainers are verl's registered v1 classes built by their real ``__init__``; only what needs GPUs
(worker groups, dataloader state) is stood in for.
"""

from __future__ import annotations

import json
import logging
import os
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import verl_group_ppo_testutils_integration as U
from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.core_algos import AdaptiveThreshold, compute_group_ppo_outputs
from verl_group_ppo.integration.checkpoint import STATE_FILE
from verl_group_ppo.integration.critic_loss import CRITIC_WEIGHTS_KEY, boundary_value_loss
from verl_group_ppo.integration.trainer import GroupPPOTrainerMixin
from verl_group_ppo_testutils_values import handed_endpoints  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("handed_endpoints")  # the trainer hands the estimator its groups' endpoints

STORED = ["advantages", "returns"]
ROLLOUT_CORRECTION = ["algorithm.rollout_correction.rollout_is=token",
                      "algorithm.rollout_correction.rollout_rs=token_k2",
                      "algorithm.rollout_correction.rollout_rs_threshold=0.5"]


def uids_of(meta) -> np.ndarray:
    return np.array([key.split("_")[0] for key in meta.keys], dtype=object)


def expected_outputs(trainer, meta, threshold: float):
    """The core's outputs on exactly what verl's advantage step handed the estimator (read back from TQ)."""
    fields = ["response_mask", "values", "old_log_probs", "rm_scores"]
    if trainer.config.algorithm.use_kl_in_reward:
        fields.append("token_level_rewards")
    stored = U.get_padded(meta, fields)
    rewards = stored.get("token_level_rewards", stored["rm_scores"])
    return compute_group_ppo_outputs(rewards, stored["response_mask"], values=stored["values"], index=uids_of(meta),
                                     settings=read_algorithm_settings(trainer.config.algorithm),
                                     old_log_probs=stored["old_log_probs"], threshold=threshold)


def expected_weights(meta, critic_mask: torch.Tensor) -> torch.Tensor:
    """Step 7's weights with N counted as verl's token-mean divides: the batch's loss_mask tokens."""
    n_loss = float(U.get_padded(meta, ["loss_mask"])["loss_mask"].sum())
    return (critic_mask * (n_loss / float(critic_mask.sum()))).float()


# ----------------------------------------------------------------------------------------------------
# the advantage step


@pytest.mark.parametrize("overrides", [
    [],
    ["algorithm.use_kl_in_reward=true"],
    ["algorithm.use_kl_in_reward=true", *ROLLOUT_CORRECTION],
    ["++algorithm.group_params.boundary_rule=low_prob", "++algorithm.group_params.adv_norm=prompt"],
], ids=["plain", "kl_in_reward", "kl_and_rollout_correction", "low_prob_prompt_norm"])
def test_advantage_step_stores_exactly_the_core_outputs(ray_tq, overrides, handed_endpoints):
    trainer = U.make_trainer(overrides)
    samples = U.make_samples(seed=len(overrides))
    meta = U.put_samples(samples)
    metrics: dict = {}
    out = trainer._compute_advantage(meta, metrics)

    assert set(STORED + [CRITIC_WEIGHTS_KEY]) <= set(out.fields)  # the returned metadata lists the new fields
    assert "critic_mask" not in out.fields  # the weights say where the boundaries are (weight > 0)
    stored = U.get_padded(out, STORED + [CRITIC_WEIGHTS_KEY, "response_mask", "rm_scores"])
    expected = expected_outputs(trainer, out, threshold=1.0)
    for name in STORED:
        assert torch.equal(stored[name], getattr(expected, name)), name
    weights = stored[CRITIC_WEIGHTS_KEY]
    assert weights.dtype == torch.float32
    assert torch.equal(weights > 0, expected.critic_mask > 0)
    assert torch.equal(weights, expected_weights(out, expected.critic_mask))
    if ROLLOUT_CORRECTION[0] not in overrides:  # nothing rejected: exactly the core's N_valid / N_boundary
        assert torch.equal(weights, expected.critic_loss_weights.float())
    core_metrics = dict(expected.metrics)
    if metrics["group/prompts_scored_alike"] == 1.0:  # no prompt's replies differ: the boundary EV is left out
        del core_metrics["group/boundary_explained_variance"]
    assert {k: metrics[k] for k in core_metrics} == core_metrics
    assert metrics["group/threshold"] == 1.0
    assert handed_endpoints == [None]  # with the critic's values the estimator finds the groups
    # verl's own steps ran on the way
    if "algorithm.use_kl_in_reward=true" in overrides:
        assert "actor/reward_kl_penalty" in metrics
        rewards = U.get_padded(out, ["token_level_rewards"])["token_level_rewards"]
        assert not torch.equal(rewards, stored["rm_scores"])
    if ROLLOUT_CORRECTION[0] in overrides:
        original = U.get_padded(meta, ["loss_mask"])["loss_mask"]
        assert (stored["response_mask"] != original).any(), "rejection sampling should have masked tokens"
        assert "rollout_is_weights" in out.fields


def test_group_metrics_come_from_the_core(ray_tq):
    trainer = U.make_trainer(["++algorithm.group_params.policy_lam=0.9", "++algorithm.group_params.critic_lam=0.95"])
    metrics: dict = {}
    out = trainer._compute_advantage(U.put_samples(U.make_samples(seed=9)), metrics)
    expected = expected_outputs(trainer, out, threshold=1.0)
    assert {"group/size_p50", "group/size_p90", "group/policy_lam", "group/critic_lam"} <= set(metrics)
    assert (metrics["group/policy_lam"], metrics["group/critic_lam"]) == (0.9, 0.95)
    assert {k: metrics[k] for k in expected.metrics} == expected.metrics


def test_boundary_ev_is_left_out_of_a_step_where_every_prompt_scored_alike(ray_tq):
    trainer = U.make_trainer()
    samples = U.make_samples(n_prompts=3, n_per_prompt=2, seed=9, with_padding_row=False)
    scores = [float(s["rm_scores"].sum()) for s in samples]
    differs = [scores[2 * p] != scores[2 * p + 1] for p in range(3)]
    assert any(differs), "the seed must give a prompt whose replies differ"
    metrics: dict = {}
    trainer._compute_advantage(U.put_samples(samples), metrics)
    assert metrics["group/prompts_scored_alike"] == pytest.approx(1 - sum(differs) / 3)
    assert "group/boundary_explained_variance" in metrics
    for s in samples:  # every reply scores 1 at its last token: no prompt has a signal
        s["rm_scores"] = torch.zeros_like(s["rm_scores"])
        s["rm_scores"][-1] = 1.0
    metrics = {}
    trainer._compute_advantage(U.put_samples(samples), metrics)
    assert metrics["group/prompts_scored_alike"] == 1.0
    assert "group/boundary_explained_variance" not in metrics
    assert "group/mean_group_size" in metrics


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_every_trainer_mode_runs_the_group_advantage_step(ray_tq, mode):
    trainer = U.make_trainer(["algorithm.use_kl_in_reward=true"], mode=mode)
    out = trainer._compute_advantage(U.put_samples(U.make_samples(seed=5)), {})
    stored = U.get_padded(out, STORED + [CRITIC_WEIGHTS_KEY])
    expected = expected_outputs(trainer, out, threshold=1.0)
    for name in STORED:
        assert torch.equal(stored[name], getattr(expected, name)), name
    assert torch.equal(stored[CRITIC_WEIGHTS_KEY], expected_weights(out, expected.critic_mask))


@pytest.mark.parametrize("target", ["explained_variance", "group_size"])
def test_threshold_adapts_per_batch_and_feeds_the_next_one(ray_tq, target):
    trainer = U.make_trainer(["++algorithm.group_params.threshold_lr=0.5",
                              f"++algorithm.group_params.adaptive_target={target}",
                              "++algorithm.group_params.target_group_size=2"])
    params = read_algorithm_settings(trainer.config.algorithm).group
    first = trainer._compute_advantage(U.put_samples(U.make_samples(seed=1)), {})
    expected = AdaptiveThreshold(params)
    expected.update(expected_outputs(trainer, first, threshold=1.0))
    assert trainer.group_threshold.value == expected.value != 1.0

    metrics: dict = {}
    second = trainer._compute_advantage(U.put_samples(U.make_samples(seed=2)), metrics)
    assert metrics["group/threshold"] == expected.value
    stored = U.get_padded(second, ["advantages"])["advantages"]
    assert torch.equal(stored, expected_outputs(trainer, second, threshold=expected.value).advantages)


def test_critic_fields_reach_the_critic_loss_micro_batches(ray_tq):
    trainer = U.make_trainer()
    out = trainer._compute_advantage(U.put_samples(U.make_samples(seed=3)), {})
    seen = []

    def recording_loss(model_output, data, dp_group=None, config=None):
        seen.append(data[CRITIC_WEIGHTS_KEY].values().clone())
        return boundary_value_loss(config, model_output, data, dp_group)

    from verl_group_ppo.integration.critic_loss import BoundaryLossConfig

    loss_fn = partial(recording_loss, config=BoundaryLossConfig(cliprange_value=0.2))
    U.critic_losses_through_verl(out, loss_fn, dp_size=2, mini_batch_size=6, micro_batch_size=1)
    assert len(seen) == 6
    expected = expected_outputs(trainer, out, threshold=1.0)
    stored = U.get_padded(out, ["response_mask"])
    assert sum(int((s > 0).sum()) for s in seen) == int(expected.critic_mask.sum()) > 0
    total_weight = sum(float(s.sum()) for s in seen)
    assert total_weight == pytest.approx(float(stored["response_mask"].sum()))  # N_valid


def test_other_estimators_get_verls_trainer_behaviour(ray_tq, tmp_path):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    trainer = U.make_trainer(["algorithm.adv_estimator=gae", f"trainer.default_local_dir={tmp_path}"])
    assert isinstance(trainer, GroupPPOTrainerMixin) and not trainer.group_ppo_enabled
    out = trainer._compute_advantage(U.put_samples(U.make_samples(seed=4)), {})
    assert CRITIC_WEIGHTS_KEY not in out.fields
    stored = U.get_padded(out, ["advantages", "returns", "response_mask", "rm_scores", "values"])
    adv, ret = compute_gae_advantage_return(stored["rm_scores"], stored["values"], stored["response_mask"],
                                            gamma=1.0, lam=1.0)
    valid = stored["response_mask"].bool()
    assert torch.equal(stored["advantages"][valid], adv[valid])
    assert torch.equal(stored["returns"][valid], ret[valid])


# ----------------------------------------------------------------------------------------------------
# critic warm-up: verl's step loop with stand-in workers


class StandInReplayBuffer:
    """Hands out stored batches in order, as verl's replay buffer hands out rollouts."""

    def __init__(self, batches):
        self.batches = list(batches)

    def sample(self, global_steps, partition_id, batch_size):
        return self.batches.pop(0), {}


def run_steps(trainer, n_steps: int) -> list[dict]:
    """verl's real ``_step_once`` for global steps 1..n_steps; only what needs workers is stood in (rewards,
    log-probs and values are already stored with the samples). Returns per step what ran."""
    trainer.replay_buffer = StandInReplayBuffer(U.put_samples(U.make_samples(seed=20 + i)) for i in range(n_steps))
    trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=["stand-in"])  # rewards stored already
    trainer.checkpoint_manager = SimpleNamespace(sleep_replicas=lambda: None)  # the rollout replicas
    trainer.curr_step_profile = False
    for name in ("_balance_batch", "_compute_old_log_prob", "_compute_ref_log_prob", "_compute_values"):
        setattr(trainer, name, lambda batch, metrics, **kwargs: batch)
    steps = []
    trainer._update_critic = lambda batch, metrics: steps[-1].update(critic=True) or batch
    trainer._update_actor = lambda batch, metrics: steps[-1].update(actor=True) or batch
    for step in range(1, n_steps + 1):
        trainer.global_steps = step
        steps.append({"critic": False, "actor": False, "threshold_used": trainer.group_threshold.value})
        metrics: dict = {}
        trainer._step_once(metrics, {}, sample_batch_size=6)
        steps[-1].update(group_metrics="group/threshold" in metrics, threshold_after=trainer.group_threshold.value)
    return steps


def test_critic_warmup_updates_only_the_critic_while_groups_and_threshold_run(ray_tq):
    # verl 0.9.1 updates the actor when trainer.critic_warmup <= global_steps (trainer_base's _step_once), counting
    # steps from 1 (fit adds 1 before each step): critic_warmup=3 leaves steps 1 and 2 to the critic alone.
    trainer = U.make_trainer(["trainer.critic_warmup=3", "++algorithm.group_params.threshold_lr=0.5"])
    steps = run_steps(trainer, 4)
    assert [s["critic"] for s in steps] == [True] * 4
    assert [s["actor"] for s in steps] == [False, False, True, True]
    assert all(s["group_metrics"] for s in steps)  # GROUP-PPO's advantage step ran every step
    # the threshold adapted in the warm-up steps too, each step using the previous step's value
    assert steps[0]["threshold_after"] != steps[0]["threshold_used"] == 1.0
    assert all(later["threshold_used"] == earlier["threshold_after"] for earlier, later in zip(steps, steps[1:]))


# ----------------------------------------------------------------------------------------------------
# the groups of a real run beside verl's rollout dump


class StandInTokenizer:
    """Token id i decodes to ``t{i}``."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{int(i)}" for i in ids)

    def batch_decode(self, sequences, skip_special_tokens=False):
        return [self.decode(ids) for ids in sequences]


def test_rollout_dump_writes_the_groups_beside_verls(ray_tq, tmp_path):
    dump = tmp_path / "rollouts"
    trainer = U.make_trainer([f"trainer.rollout_data_dir={dump}", *ROLLOUT_CORRECTION])
    trainer.tokenizer = StandInTokenizer()
    trainer._init_dump_executor()  # what verl's _setup does for the dump (it needs GPUs for the rest)
    for step, seed in ((4, 6), (5, 7)):
        trainer.global_steps = step
        samples = U.make_samples(seed=seed)
        threshold_used = trainer.group_threshold.value
        out = trainer._compute_advantage(U.put_samples(samples), {})
        trainer._log_rollout_data(out, {}, str(dump))  # verl's fit calls this after the step
    trainer._shutdown_dump_executor()  # verl writes its own file on a thread

    assert sorted(os.listdir(dump)) == ["4.groups.jsonl", "4.jsonl", "5.groups.jsonl", "5.jsonl"]
    with open(dump / "5.groups.jsonl") as f:
        records = [json.loads(line) for line in f]
    expected = expected_outputs(trainer, out, threshold=threshold_used)
    stored = U.get_padded(out, ["response_mask", "responses", "rm_scores"])  # the mask the estimator saw
    assert len(records) == len(samples)
    for i, record in enumerate(records):
        valid = stored["response_mask"][i].bool()
        assert set(record) == {"step", "uid", "score", "tokens", "group_ids", "advantages", "endpoints", "row"}
        span = int(valid.nonzero().max()) + 1 if valid.any() else 0  # every position up to the last valid one
        row = record["row"]
        assert row["threshold"] == threshold_used
        assert row["response_mask"] == stored["response_mask"][i, :span].int().tolist()
        assert row["response_ids"] == stored["responses"][i, :span].tolist()
        assert row["advantages"] == pytest.approx(expected.advantages[i, :span].tolist())
        assert row["returns"] == pytest.approx(expected.returns[i, :span].tolist())
        assert row["critic_mask"] == expected.critic_mask[i, :span].tolist()
        assert (record["step"], record["uid"]) == (5, samples[i]["uid"])
        assert record["score"] == pytest.approx(float(stored["rm_scores"][i].sum()))
        assert record["tokens"] == [f"t{t}" for t in stored["responses"][i][valid].tolist()]
        assert record["group_ids"] == expected.group_ids[i][valid].tolist()
        assert record["advantages"] == pytest.approx(expected.advantages[i][valid].tolist())
        assert record["endpoints"] == expected.endpoint_mask[i][valid].int().tolist()
    assert records[-1]["tokens"] == []  # the padding row has no valid token
    assert sum(len(r["tokens"]) for r in records) < sum(len(s["responses"]) for s in samples)  # rejection masked
    # the demo's reader draws exactly this format
    from verl_group_ppo.viz import render_dump

    assert render_dump(str(dump), str(tmp_path / "groups.html"), steps="all") == [4, 5]
    assert records[0]["tokens"][0] in (tmp_path / "groups.html").read_text()


def test_a_tree_rollouts_dump_and_metrics_carry_each_rows_tree_position(ray_tq, tmp_path):
    dump = tmp_path / "rollouts"
    trainer = U.make_trainer([f"trainer.rollout_data_dir={dump}",
                              "actor_rollout_ref.rollout.agent.default_agent_loop=tree_single_turn"])
    trainer.tokenizer = StandInTokenizer()
    trainer._init_dump_executor()
    trainer.global_steps = 3
    samples = U.make_samples(seed=6)
    for i, sample in enumerate(samples):  # each prompt's second reply branched from its first after 2 tokens
        child = i % 2 == 1
        sample["extra_fields"] = {"tree_parent": i - 1 if child else -1, "tree_branch_position": 2 if child else 0,
                                  "tree_generated_tokens": len(sample["responses"]) - (2 if child else 0),
                                  "tree_level": int(child), "tree_generate_s": 0.5 if child else 2.0}
    metrics: dict = {}
    out = trainer._compute_advantage(U.put_samples(samples), metrics)
    trainer._log_rollout_data(out, {}, str(dump))
    trainer._shutdown_dump_executor()
    with open(dump / "3.groups.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["tree"] for r in records] == [
        {"parent": i - 1 if i % 2 else -1, "branch_position": 2 if i % 2 else 0, "level": i % 2}
        for i in range(len(samples))]
    assert (metrics["group/tree_round0_generate_s"], metrics["group/tree_round1_generate_s"]) == (2.0, 0.5)
    lengths = [len(s["responses"]) for s in samples]
    assert metrics["group/tree_path_tokens"] == sum(lengths)
    assert metrics["group/tree_generated_tokens"] == sum(lengths) - 2 * (len(samples) // 2)


def test_other_estimators_dump_no_groups(ray_tq, tmp_path):
    trainer = U.make_trainer(["algorithm.adv_estimator=gae", f"trainer.rollout_data_dir={tmp_path}"])
    trainer.tokenizer = StandInTokenizer()
    trainer._init_dump_executor()
    trainer.global_steps = 1
    out = trainer._compute_advantage(U.put_samples(U.make_samples(seed=8)), {})
    trainer._log_rollout_data(out, {}, str(tmp_path))
    trainer._shutdown_dump_executor()
    assert os.listdir(tmp_path) == ["1.jsonl"]


# ----------------------------------------------------------------------------------------------------
# the start-up line


def startup_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("verl_group_ppo") and "adv_estimator=group_ppo active" in r.getMessage()]


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_a_group_ppo_trainer_logs_one_start_up_line_naming_estimator_trainer_and_settings(caplog, mode):
    with caplog.at_level(logging.INFO):
        trainer = U.make_trainer(["++algorithm.group_params.group_max_size=8", "algorithm.lam=0.9"], mode=mode)
    group = ", ".join(f"{k}={v}" for k, v in trainer.group_settings.group.to_dict().items())
    assert startup_lines(caplog) == [
        f"verl-group-ppo: algorithm.adv_estimator=group_ppo active (trainer: {type(trainer).__name__}, "
        f"trainer_mode: {mode}); gamma=1.0, lam=0.9, norm_adv_by_std_in_grpo=True; group_params: {group}"]
    assert type(trainer).__name__.startswith("GroupPPOTrainer") and "group_max_size=8" in group


def test_other_estimators_log_no_start_up_line(caplog):
    with caplog.at_level(logging.INFO):
        U.make_trainer(["algorithm.adv_estimator=grpo"])
    assert startup_lines(caplog) == []


def test_the_start_up_line_shows_at_verls_default_log_level(caplog):
    # `import verl` sets the root logger to WARNING; the trainer module's logger is at INFO, as verl's are
    import verl_group_ppo.integration.trainer as trainer_module

    assert trainer_module.logger.getEffectiveLevel() <= logging.INFO
    U.make_trainer()
    assert len(startup_lines(caplog)) == 1


# ----------------------------------------------------------------------------------------------------
# setup: the boundary loss replaces the value_loss verl installed


class StandInWorkerGroup:
    """Records what the trainer asks of a worker group (verl's engines need GPUs)."""

    def __init__(self, on_save=None):
        self.loss_fn = None
        self.saved, self.loaded = [], []
        self.on_save = on_save

    def set_loss_fn(self, loss_fn):
        self.loss_fn = loss_fn

    def save_checkpoint(self, local_path, remote_path=None, global_step=0, max_ckpt_to_keep=None):
        if self.on_save:
            self.on_save(local_path)
        os.makedirs(local_path, exist_ok=True)
        self.saved.append(local_path)

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loaded.append(local_path)


class StandInDataloader:
    def __init__(self):
        self.state = None

    def state_dict(self):
        return {"seen": 7}

    def load_state_dict(self, state):
        self.state = state


@pytest.mark.parametrize("critic_loss_on", ["boundaries", "all_tokens"])
def test_setup_installs_the_boundary_critic_loss_after_verls(monkeypatch, critic_loss_on):
    from verl.trainer.ppo.v1 import trainer_base
    from verl.workers.utils.losses import value_loss

    def verls_setup(self):  # what verl's _setup does for the critic, without GPUs
        self.critic_wg = StandInWorkerGroup()
        self.critic_wg.set_loss_fn(partial(value_loss, config="verl's CriticConfig"))

    monkeypatch.setattr(trainer_base.PPOTrainer, "_setup", verls_setup)
    trainer = U.make_trainer([f"++algorithm.group_params.critic_loss_on={critic_loss_on}",
                              "critic.cliprange_value=0.3"])
    trainer._setup()
    loss_fn = trainer.critic_wg.loss_fn
    if critic_loss_on == "boundaries":
        assert loss_fn.func is boundary_value_loss and loss_fn.keywords["config"].cliprange_value == 0.3
    else:
        assert loss_fn.func is value_loss


# ----------------------------------------------------------------------------------------------------
# checkpoints


def attach_stand_ins(trainer, on_save=None):
    trainer.actor_rollout_wg = StandInWorkerGroup(on_save)
    trainer.critic_wg = StandInWorkerGroup()
    trainer.train_dataloader = StandInDataloader()


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_threshold_checkpoint_round_trip(tmp_path, mode, ray_tq):
    ckpt = str(tmp_path / "ckpt")
    trainer = U.make_trainer([f"trainer.default_local_dir={ckpt}"], mode=mode)
    state_path = os.path.join(ckpt, "global_step_3", STATE_FILE)
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    order = []
    attach_stand_ins(trainer, on_save=lambda _: order.append((os.path.exists(state_path), os.path.exists(tracker))))
    trainer.global_steps = 3
    trainer.group_threshold.load_state_dict({"threshold": 2.5})
    trainer._save_checkpoint()
    assert order == [(True, False)]  # our state is on disk before verl saves anything, the tracker comes last
    with open(state_path) as f:
        assert json.load(f)["threshold_state"] == {"threshold": 2.5}

    resumed = U.make_trainer([f"trainer.default_local_dir={ckpt}", "trainer.resume_mode=auto"], mode=mode)
    attach_stand_ins(resumed)
    assert resumed.group_threshold.value == 1.0
    resumed._load_checkpoint()
    assert resumed.global_steps == 3 and resumed.group_threshold.value == 2.5
    assert resumed.actor_rollout_wg.loaded == [os.path.join(ckpt, "global_step_3", "actor")]

    by_path = U.make_trainer(["trainer.resume_mode=resume_path",
                              f"trainer.resume_from_path={os.path.join(ckpt, 'global_step_3')}"], mode=mode)
    attach_stand_ins(by_path)
    by_path._load_checkpoint()
    assert by_path.group_threshold.value == 2.5


def test_resume_without_group_state_keeps_the_configured_threshold(tmp_path, caplog):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(ckpt, "global_step_2"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    trainer = U.make_trainer([f"trainer.default_local_dir={ckpt}", "trainer.resume_mode=auto",
                              "++algorithm.group_params.group_variance_threshold=0.7"])
    attach_stand_ins(trainer)
    trainer._load_checkpoint()
    assert trainer.global_steps == 2 and trainer.group_threshold.value == 0.7
    assert STATE_FILE in caplog.text


def test_other_estimators_save_no_group_state(tmp_path):
    trainer = U.make_trainer(["algorithm.adv_estimator=grpo", f"trainer.default_local_dir={tmp_path}"])
    attach_stand_ins(trainer)
    trainer.global_steps = 1
    trainer._save_checkpoint()
    assert os.path.exists(os.path.join(tmp_path, "global_step_1", "data.pt"))
    assert not os.path.exists(os.path.join(tmp_path, "global_step_1", STATE_FILE))
