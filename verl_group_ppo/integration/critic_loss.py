"""The GROUP-PPO critic loss (docs/algorithm.md, step 7) in verl's loss-function convention.

verl's critic worker group calls ``loss_fn(model_output, data=micro_batch)`` with one micro-batch at a
time; the trainer installs it with ``critic_wg.set_loss_fn`` (see :mod:`verl_group_ppo.integration.trainer`).

``critic_loss_on: boundaries`` (default): verl's clipped value loss, ``compute_value_loss``, with the
per-token weights ``critic_loss_weights`` as its mask. The advantage step stores them
(:func:`verl_group_ppo.core_algos.boundary_loss_weights` with verl's ``loss_mask``): N / N_boundary at each
group's value slot, 0 elsewhere, where N counts the batch's ``loss_mask`` tokens, which is what verl's
engines divide by (``batch_num_tokens``), so the loss is the mean over boundary positions when the
mini-batch is the whole batch, and it does not depend on the micro-batch split or the data-parallel size.
Rollout-correction rejection rewrites only ``response_mask``, not ``loss_mask``: counting
``response_mask`` would scale the loss by kept / all tokens. A
position is a boundary position exactly when its weight is > 0. A micro-batch without boundary
positions contributes exactly 0. The weights stay float32 whatever the prediction dtype (bf16 would
round them by up to 2e-3).

``critic_loss_on: all_tokens``: verl's ``value_loss`` unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from tensordict import TensorDict

from verl.trainer.ppo.core_algos import compute_value_loss
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.utils.torch_functional import masked_mean
from verl.workers.utils.losses import value_loss
from verl.workers.utils.padding import no_padding_2_padding

from verl_group_ppo.config import check_critic_loss_agg_mode, select

CRITIC_WEIGHTS_KEY = "critic_loss_weights"
"""TransferQueue field: N_loss_mask / N_boundary at each group's value slot, 0 elsewhere (float32)."""


@dataclass(frozen=True)
class BoundaryLossConfig:
    """The two critic settings the boundary loss reads (small and cheap to ship to the critic workers)."""

    cliprange_value: float
    loss_agg_mode: str = "token-mean"

    @classmethod
    def from_critic_config(cls, critic: Any) -> "BoundaryLossConfig":
        """From verl's ``critic`` config: a DictConfig, a mapping or a ``CriticConfig``."""
        return cls(cliprange_value=float(select(critic, "cliprange_value", 0.5)),
                   loss_agg_mode=str(select(critic, "loss_agg_mode", "token-mean")))


def make_critic_loss_fn(critic_config: Any, critic_loss_on: str) -> Callable[..., Any]:
    """The loss function for ``critic_wg.set_loss_fn``.

    ``boundaries``: :func:`boundary_value_loss` (``critic_config`` may be verl's DictConfig or
    ``CriticConfig``; a ``critic.loss_agg_mode`` other than token-mean is a ValueError).
    ``all_tokens``: verl's ``value_loss`` with ``critic_config`` (a ``CriticConfig``), as verl sets it.
    """
    if critic_loss_on == "all_tokens":
        return partial(value_loss, config=critic_config)
    if critic_loss_on == "boundaries":
        config = BoundaryLossConfig.from_critic_config(critic_config)
        check_critic_loss_agg_mode(config.loss_agg_mode)
        return partial(boundary_value_loss, config=config)
    raise ValueError(
        f"algorithm.group_params.critic_loss_on must be 'boundaries' or 'all_tokens', got {critic_loss_on!r}")


def boundary_value_loss(config: Any, model_output: dict, data: TensorDict, dp_group=None):
    """verl's clipped value loss at the boundary positions, weighted per docs/algorithm.md, step 7.

    Args:
        config: a :class:`BoundaryLossConfig` (or verl's ``CriticConfig``): ``cliprange_value`` and
            ``loss_agg_mode``, which must be token-mean.
        model_output: the critic's output; ``values`` in verl's no-padding layout (prompt + response).
        data: one micro-batch: nested ``values``, ``returns``, ``response_mask``, ``critic_loss_weights``,
            plus verl's ``dp_size``, ``batch_num_tokens`` and ``global_batch_size``.
        dp_group: unused (verl's signature).

    Returns:
        ``(vf_loss, metrics)`` with verl's ``critic/vf_loss``, ``critic/vf_clipfrac`` (over boundary
        positions) and ``critic/vpred_mean`` (over valid tokens, as verl reports it).
    """
    check_critic_loss_agg_mode(config.loss_agg_mode)
    if CRITIC_WEIGHTS_KEY not in data.keys():
        raise KeyError(
            f"the critic micro-batch has no '{CRITIC_WEIGHTS_KEY}' field: the GROUP-PPO trainer stores it in the "
            "advantage step; the critic must be trained from the metadata that step returns.")
    vpreds = no_padding_2_padding(model_output["values"], data)
    dp_size = tu.get_non_tensor_data(data, key="dp_size", default=1) or 1
    padded = data.select("values", "returns", "response_mask", CRITIC_WEIGHTS_KEY).to_padded_tensor()
    response_mask = padded["response_mask"].bool()
    weights = padded[CRITIC_WEIGHTS_KEY].to(torch.float32)

    # Only boundary positions may reach the loss, gradients included: select them with `where` so that
    # anything stored elsewhere (even non-finite) cannot turn a zero weight into a NaN gradient.
    boundary = weights > 0
    vf_loss, vf_clipfrac = compute_value_loss(
        vpreds=vpreds,
        returns=torch.where(boundary, padded["returns"], vpreds.detach()),
        values=torch.where(boundary, padded["values"], vpreds.detach()),
        response_mask=weights,  # a weight per position: verl's masked_sum multiplies by it
        cliprange_value=config.cliprange_value,
        loss_agg_mode="token-mean",
        dp_size=dp_size,
        batch_num_tokens=_batch_num_tokens(data, dp_size),
        global_batch_size=tu.get_non_tensor_data(data, key="global_batch_size", default=None),
    )
    metrics = {
        "critic/vf_loss": Metric(value=vf_loss, aggregation=_loss_metric_aggregation(data, dp_size)),
        "critic/vf_clipfrac": vf_clipfrac.detach().item(),
        "critic/vpred_mean": masked_mean(vpreds, response_mask).detach().item(),
    }
    return vf_loss, metrics


def _batch_num_tokens(data: TensorDict, dp_size: int) -> Any:
    """verl's global token count; without one (a single rank), this micro-batch's ``loss_mask`` count
    (its ``response_mask`` count when it has no ``loss_mask``), as verl's engines count."""
    count = tu.get_non_tensor_data(data, key="batch_num_tokens", default=None)
    if count is not None:
        return count
    if dp_size > 1:
        raise ValueError("batch_num_tokens (verl's global token count) is required when dp_size > 1")
    mask = data["loss_mask"] if "loss_mask" in data.keys() else data["response_mask"]
    return int(mask.values().sum()) if mask.is_nested else int(mask.sum())


def _loss_metric_aggregation(data: TensorDict, dp_size: int) -> AggregationType:
    """SUM when the loss is normalised over the global mini-batch (each micro-batch a partial sum), as verl."""
    global_counts = any(tu.get_non_tensor_data(data, key=key, default=None) is not None
                        for key in ("batch_num_tokens", "global_batch_size"))
    if dp_size > 1 or global_counts:
        return AggregationType.SUM
    return AggregationType.MEAN


__all__ = ["BoundaryLossConfig", "CRITIC_WEIGHTS_KEY", "boundary_value_loss", "make_critic_loss_fn"]
