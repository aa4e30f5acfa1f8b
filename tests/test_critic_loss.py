"""The GROUP-PPO critic loss (docs/algorithm.md, step 7) through verl's own critic data path, and its edge cases."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from tensordict import TensorDict

import verl_group_ppo_testutils_integration as U
from verl.trainer.ppo.core_algos import compute_value_loss
from verl.utils import tensordict_utils as tu
from verl.workers.config import CriticConfig
from verl.workers.utils.losses import value_loss
from verl.workers.utils.padding import no_padding_2_padding
from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.core_algos import boundary_loss_weights, compute_group_ppo_outputs
from verl_group_ppo.integration.critic_loss import (
    CRITIC_WEIGHTS_KEY,
    BoundaryLossConfig,
    boundary_value_loss,
    make_critic_loss_fn,
)

CLIP = 0.2
ROLLOUT_REJECTION = ["algorithm.rollout_correction.rollout_is=token",
                     "algorithm.rollout_correction.rollout_rs=token_k2",
                     "algorithm.rollout_correction.rollout_rs_threshold=0.5"]


@pytest.fixture(scope="module")
def advantage_batch(ray_tq):
    """A batch after the GROUP-PPO advantage step (6 responses, holes, one padding row), stored in TQ."""
    trainer = U.make_trainer(["++algorithm.group_params.group_variance_threshold=2.0"])
    return trainer._compute_advantage(U.put_samples(U.make_samples(seed=11)), {})


@pytest.fixture(scope="module")
def rejected_batch(ray_tq):
    """As ``advantage_batch``, with rollout-correction rejection sampling masking some tokens: it rewrites
    ``response_mask`` but not ``loss_mask``, which verl's engines count for the token-mean."""
    trainer = U.make_trainer(["++algorithm.group_params.group_variance_threshold=2.0", *ROLLOUT_REJECTION])
    meta = trainer._compute_advantage(U.put_samples(U.make_samples(seed=11)), {})
    masks = U.get_padded(meta, ["response_mask", "loss_mask"])
    assert masks["response_mask"].sum() < masks["loss_mask"].sum(), "rejection should have masked tokens"
    return meta


def reference_boundary_loss(meta) -> float:
    """0.5 * mean over boundary positions of verl's clipped value loss (docs/algorithm.md, Step 7); the
    boundary positions are where the advantage step stored a weight > 0 (tests/test_trainer.py checks
    they are the core's critic mask)."""
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                           select_fields=["prompts", "responses", "values", "returns", CRITIC_WEIGHTS_KEY,
                                          U.FAKE_VPRED_KEY])
    vpreds = no_padding_2_padding(data[U.FAKE_VPRED_KEY], data)
    padded = data.select("values", "returns", CRITIC_WEIGHTS_KEY).to_padded_tensor()
    loss, _ = compute_value_loss(vpreds=vpreds, returns=padded["returns"], values=padded["values"],
                                 response_mask=padded[CRITIC_WEIGHTS_KEY] > 0, cliprange_value=CLIP,
                                 loss_agg_mode="token-mean")
    return float(loss)


def boundary_loss_fn():
    return make_critic_loss_fn(CriticConfig(strategy="fsdp", cliprange_value=CLIP, ppo_micro_batch_size_per_gpu=1),
                               "boundaries")


def test_full_batch_loss_is_the_mean_over_boundary_positions(advantage_batch):
    losses, metrics = U.critic_losses_through_verl(advantage_batch, boundary_loss_fn(), dp_size=1,
                                                   mini_batch_size=6, micro_batch_size=6)
    assert losses[0] == pytest.approx(reference_boundary_loss(advantage_batch), rel=1e-6)
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"} <= set(metrics[0])
    assert 0.0 <= metrics[0]["critic/vf_clipfrac"] <= 1.0


@pytest.mark.parametrize("dp_size,micro_batch_size", [(1, 1), (1, 2), (2, 1), (2, 3), (3, 2)])
def test_loss_is_invariant_to_micro_batch_split_and_dp_size(advantage_batch, dp_size, micro_batch_size):
    losses, _ = U.critic_losses_through_verl(advantage_batch, boundary_loss_fn(), dp_size=dp_size,
                                            mini_batch_size=6, micro_batch_size=micro_batch_size)
    assert losses[0] == pytest.approx(reference_boundary_loss(advantage_batch), rel=1e-6)


@pytest.mark.parametrize("dp_size,micro_batch_size", [(1, 6), (2, 1)])
def test_rejection_sampling_keeps_the_loss_the_mean_over_boundary_positions(rejected_batch, dp_size,
                                                                             micro_batch_size):
    # Issue 9: weights counted from the rewritten response_mask scaled the loss by kept / all tokens.
    losses, _ = U.critic_losses_through_verl(rejected_batch, boundary_loss_fn(), dp_size=dp_size,
                                            mini_batch_size=6, micro_batch_size=micro_batch_size)
    assert losses[0] == pytest.approx(reference_boundary_loss(rejected_batch), rel=1e-6)


def test_weights_count_loss_mask_tokens():
    critic_mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    loss_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    weights = boundary_loss_weights(critic_mask, loss_mask)
    assert weights.dtype == torch.float32
    assert torch.equal(weights, critic_mask * (7 / 3))
    assert torch.equal(boundary_loss_weights(torch.zeros(2, 4), loss_mask), torch.zeros(2, 4))


def test_weights_count_the_mask_given_not_the_response_mask():
    # Rejection sampling zeroes response_mask tokens but leaves loss_mask: the core's weights count
    # response_mask, the trainer's the loss_mask it is given; both from the same function.
    g = torch.Generator().manual_seed(3)
    loss_mask = torch.ones(4, 6)
    response_mask = loss_mask.clone()
    response_mask[1, 3:] = 0
    response_mask[3] = 0  # a rejected response
    rewards, values = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    out = compute_group_ppo_outputs(rewards, response_mask, values=values,
                                    settings=read_algorithm_settings({"group_params": {"group_max_size": 2}}))
    n_boundary = int(out.critic_mask.sum())
    assert torch.equal(out.critic_loss_weights, out.critic_mask * (int(response_mask.sum()) / n_boundary))
    trainer_weights = boundary_loss_weights(out.critic_mask, loss_mask)
    assert torch.equal(trainer_weights, out.critic_mask * (24 / n_boundary))
    assert not torch.equal(trainer_weights, out.critic_loss_weights)


def test_weights_reject_bad_masks():
    with pytest.raises(ValueError, match="count_mask must have the shape of critic_mask"):
        boundary_loss_weights(torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="critic_mask must contain only 0 and 1"):
        boundary_loss_weights(torch.full((2, 4), 0.5), torch.ones(2, 4))
    with pytest.raises(ValueError, match="count_mask must be a 2-D tensor"):
        boundary_loss_weights(torch.zeros(2, 4), [1, 1])


def test_weights_stay_float32_under_bf16_predictions():
    # Issue 9: casting the weights to the prediction dtype rounded 1000/137 by 1.8e-3 under bf16.
    weight = 1000 / 137
    data = _micro_batch([[weight, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    vpreds = _vpreds(6, 6, leaf=torch.zeros(12, dtype=torch.bfloat16))
    loss, _ = boundary_value_loss(BoundaryLossConfig(cliprange_value=10.0), {"values": vpreds}, data)
    # 0.5 * w * (0 - 1)^2 / 7 (batch_num_tokens); every other factor is exact in bf16
    assert float(loss) == pytest.approx(0.5 * weight / 7, rel=1e-6)


def test_mini_batches_sum_to_the_full_batch_loss_times_their_token_share(advantage_batch):
    # With two mini-batches each is normalised by its own token count (verl's token-mean), so
    # sum_k loss_k * tokens_k / tokens equals the full-batch loss: the weights keep the estimator unbiased.
    import transfer_queue as tq

    losses, _ = U.critic_losses_through_verl(advantage_batch, boundary_loss_fn(), dp_size=1,
                                            mini_batch_size=3, micro_batch_size=1)
    mask = tq.kv_batch_get(keys=advantage_batch.keys, partition_id=advantage_batch.partition_id,
                           select_fields=["loss_mask"])["loss_mask"]
    tokens = [int(mask[i].sum()) for i in range(len(advantage_batch))]
    shares = [sum(tokens[:3]) / sum(tokens), sum(tokens[3:]) / sum(tokens)]
    combined = sum(loss * share for loss, share in zip(losses, shares))
    assert combined == pytest.approx(reference_boundary_loss(advantage_batch), rel=1e-6)


def _micro_batch(weights: list[list[float]], returns: list[list[float]], with_globals: bool = True) -> TensorDict:
    """A hand-made critic micro-batch in verl's nested layout: response i has len(weights[i]) tokens, all
    valid, values 0, and a prompt of i + 2 tokens (lengths differ, so TensorDict keeps them nested)."""
    rows = []
    for i, (w, r) in enumerate(zip(weights, returns)):
        n = len(w)
        rows.append({"prompts": torch.ones(i + 2, dtype=torch.int64), "responses": torch.ones(n, dtype=torch.int64),
                     "values": torch.zeros(n), "returns": torch.tensor(r), "response_mask": torch.ones(n, dtype=torch.int64),
                     CRITIC_WEIGHTS_KEY: torch.tensor(w)})
    data = tu.list_of_dict_to_tensordict(rows)
    if with_globals:
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=7, global_batch_size=2)
    return data


def _vpreds(*lengths: int, leaf: torch.Tensor | None = None) -> torch.Tensor:
    """Critic outputs over prompt + response for each row in verl's no-padding layout (zeros, or ``leaf``)."""
    flat = torch.zeros(sum(lengths)) if leaf is None else leaf
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(flat, offsets=offsets)


def test_micro_batch_without_boundaries_gives_zero_not_nan():
    nan, inf = float("nan"), float("inf")
    data = _micro_batch([[0.0] * 4, [0.0] * 3], [[nan, 1.0, inf, 0.0], [2.0, nan, 0.0]])
    leaf = torch.zeros(2 + 4 + 3 + 3, requires_grad=True)
    loss, metrics = boundary_value_loss(BoundaryLossConfig(CLIP), {"values": _vpreds(6, 6, leaf=leaf)}, data)
    assert loss.item() == 0.0 and metrics["critic/vf_clipfrac"] == 0.0
    assert metrics["critic/vpred_mean"] == 0.0
    loss.backward()
    assert torch.equal(leaf.grad, torch.zeros_like(leaf))


def test_weights_scale_the_loss_and_it_needs_no_global_counts():
    data = _micro_batch([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 2.0]], [[1.0, 5.0, 5.0, 5.0], [5.0, 5.0, 3.0]],
                        with_globals=False)
    loss, _ = boundary_value_loss(BoundaryLossConfig(cliprange_value=10.0), {"values": _vpreds(6, 6)}, data)
    # 0.5 * (2 * 1^2 + 2 * 3^2) / 7 valid tokens (the local count, when verl gives no global one)
    assert loss.item() == pytest.approx(0.5 * (2 * 1 + 2 * 9) / 7)


def test_unsupported_loss_agg_mode_is_a_clear_error():
    config = CriticConfig(strategy="fsdp", loss_agg_mode="seq-mean-token-mean", ppo_micro_batch_size_per_gpu=1)
    with pytest.raises(ValueError, match=r"critic\.loss_agg_mode='seq-mean-token-mean'"):
        make_critic_loss_fn(config, "boundaries")
    with pytest.raises(ValueError, match=r"critic\.loss_agg_mode"):
        boundary_value_loss(BoundaryLossConfig(CLIP, "token-sum"), {}, TensorDict({}, batch_size=[0]))
    assert make_critic_loss_fn(config, "all_tokens").func is value_loss  # verl's loss handles every mode


def test_all_tokens_is_verls_value_loss(advantage_batch):
    config = CriticConfig(strategy="fsdp", cliprange_value=CLIP, ppo_micro_batch_size_per_gpu=1)
    ours, _ = U.critic_losses_through_verl(advantage_batch, make_critic_loss_fn(config, "all_tokens"), dp_size=2,
                                          mini_batch_size=6, micro_batch_size=1)
    verls, _ = U.critic_losses_through_verl(advantage_batch, partial(value_loss, config=config), dp_size=2,
                                           mini_batch_size=6, micro_batch_size=1)
    assert ours == verls
    assert ours[0] != pytest.approx(reference_boundary_loss(advantage_batch))


def test_missing_weights_field_is_a_clear_error():
    data = _micro_batch([[0.0] * 4, [0.0] * 3], [[0.0] * 4, [0.0] * 3])
    del data[CRITIC_WEIGHTS_KEY]
    with pytest.raises(KeyError, match=CRITIC_WEIGHTS_KEY):
        boundary_value_loss(BoundaryLossConfig(CLIP), {"values": None}, data)
