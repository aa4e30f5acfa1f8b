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

from verl_group_ppo.core_algos import boundary_loss_weights, compute_group_ppo_outputs
from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.integration.critic_loss import CRITIC_WEIGHTS_KEY, make_critic_loss_fn

pytestmark = pytest.mark.slow

RTOL = 1e-5
N_PROMPTS, N_PER_PROMPT = 2, 2  # 4 responses: 2 per rank at dp 2
MICRO = 1  # padded micro-batches of one response per rank
TOKEN_BUDGET = 24  # use_dynamic_bsz: tokens per micro-batch per rank


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 with its value head saved, so no rank initialises a weight at random."""
    from transformers import Qwen2ForTokenClassification

    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    policy = C.save_tiny_qwen2(path, seed=0)
    torch.manual_seed(1)
    config = {k: v for k, v in policy.config.to_dict().items() if k not in ("id2label", "label2id")}
    critic = Qwen2ForTokenClassification(policy.config.__class__(**config, num_labels=1))
    critic.model.load_state_dict(policy.model.state_dict())
    critic.save_pretrained(path)
    return path


def _critic_overrides(model_dir: str, strategy: str, dynamic: bool, rmpad: bool) -> list[str]:
    return [f"critic.model.path={model_dir}", "++critic.model.load_tokenizer=False",
            "+critic.model.override_config.attn_implementation=sdpa",
            f"critic.model.use_remove_padding={rmpad}", "critic.model.enable_gradient_checkpointing=False",
            f"critic.strategy={strategy}", "++critic.fsdp.mixed_precision.param_dtype=fp32",
            "critic.fsdp.use_torch_compile=False", "critic.optim.optimizer=SGD", "critic.optim.lr=1.0",
            "critic.optim.weight_decay=0.0", "critic.optim.clip_grad=1e9",
            f"critic.ppo_micro_batch_size_per_gpu={MICRO}", f"critic.use_dynamic_bsz={dynamic}",
            f"critic.ppo_max_token_len_per_gpu={TOKEN_BUDGET}"]


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


def critic_batch(seed: int = 0):
    """The global batch as the critic worker receives it (no-padding layout: nested per response)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    samples = U.make_samples(N_PROMPTS, N_PER_PROMPT, max_response=12, seed=seed, with_padding_row=False)
    rows = [{"prompts": s["prompts"] % C.VOCAB, "responses": s["responses"] % C.VOCAB,
             "response_mask": s["response_mask"], "loss_mask": s["loss_mask"], "values": s["values"],
             "rm_scores": s["rm_scores"], "uid": s["uid"]} for s in samples]
    padded = list_of_dict_to_tensordict(rows).to_padded_tensor()
    settings = read_algorithm_settings(None)
    out = compute_group_ppo_outputs(padded["rm_scores"], padded["response_mask"], values=padded["values"],
                                    settings=settings, index=[r["uid"] for r in rows])
    weights = boundary_loss_weights(out.critic_mask, padded["loss_mask"])
    for i, row in enumerate(rows):
        n = len(row["responses"])
        seq = torch.cat([row["prompts"], row["responses"]])
        row.update(input_ids=seq, position_ids=torch.arange(len(seq)), returns=out.returns[i, :n].float(),
                   advantages=out.advantages[i, :n].float(), **{CRITIC_WEIGHTS_KEY: weights[i, :n]})
        row.pop("uid"), row.pop("rm_scores")
    return list_of_dict_to_tensordict(rows)


def _updates(result: dict) -> dict[str, torch.Tensor]:
    return {k: result["after"][k] - result["before"][k] for k in result["before"]}


def _max_rel_diff(a: dict, b: dict) -> float:
    """max |a - b| / max |a| over all parameter updates."""
    scale = max(float(v.abs().max()) for v in a.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


FSDP1_SKIP = ("verl's `fsdp` strategy (torch FSDP1) cannot run on a CPU: verl wraps with sync_module_states=True, "
              "and FSDP1 then requires the parameters on a GPU (ValueError: 'The module has CPU parameters or "
              "buffers when `sync_module_states=True`')")
STRATEGIES = [pytest.param("fsdp", marks=pytest.mark.skip(reason=FSDP1_SKIP)), "fsdp2"]
MODES = ["padded", "dynamic_bsz", "remove_padding"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_critic_update_rank_invariant(model_dir, strategy, mode):
    worker, cfg = critic_worker_config(model_dir, strategy, dynamic=mode == "dynamic_bsz",
                                       rmpad=mode == "remove_padding")
    loss_fn = make_critic_loss_fn(cfg.critic, "boundaries")
    batch = critic_batch()
    n = batch.batch_size[0]
    extra = dict(global_batch_size=n, mini_batch_size=n, epochs=1, seed=1, dataloader_kwargs={"shuffle": False},
                 temperature=1.0)
    spec = dict(worker_config=worker, loss_fn=loss_fn, batch=batch, extra=extra)
    one, two = R.run_update(spec, 1), R.run_update(spec, 2)
    up1, up2 = _updates(one), _updates(two)
    assert max(float(v.abs().max()) for v in up1.values()) > 1e-4, "the update must move the critic"
    diff = _max_rel_diff(up1, up2)
    print(f"critic {strategy} {mode}: max relative update difference {diff:.2e}")
    assert diff <= RTOL
