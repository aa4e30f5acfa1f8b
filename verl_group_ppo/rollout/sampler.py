"""verl's own replay buffer, polled every 0.2 s instead of every 2 s (for short CPU steps).

verl's v1 trainer waits for a step's rollouts by polling its replay buffer, sleeping ``poll_interval``
(2.0 s, not a config key) between polls (``verl/trainer/ppo/v1/replay_buffer.py``, ``_wait_for_next_poll``).
On a GPU cluster a step's generation takes minutes and the 2 s are noise; on the tiny CPU task generation
takes 2-6 s, so ``timing_s/gen`` is rounded up to the next multiple of 2 s (measured: 4.04 s a step with
128 responses, 2.9 s with the 0.2-s poll; docs/cpu.md). The tiny launchers plug this in through verl's
custom-sampler hook::

    +trainer.v1.sampler.custom_sampler.path=pkg://verl_group_ppo.rollout.sampler
    +trainer.v1.sampler.custom_sampler.name=replay_buffer

and ``+trainer.v1.sampler.sampler_kwargs.poll_interval=<s>`` changes the interval. Nothing else differs: the
object is verl's ``ReplayBuffer`` (sync) or ``ReplayBufferAsync`` (the async trainer modes). verl passes a
custom sampler neither the sync DAPO arguments nor ``sync_refill_failed_groups``, so the launchers leave the
hook out when the run sets ``algorithm.filter_groups`` (see ``examples/cpu/common.sh``).
"""

from __future__ import annotations

from typing import Any

DEFAULT_POLL_INTERVAL_S = 0.2


def poll_interval_from(sampler_kwargs: Any) -> float:
    """``sampler_kwargs.poll_interval`` (seconds, > 0) or the default 0.2 s."""
    value = (sampler_kwargs or {}).get("poll_interval", DEFAULT_POLL_INTERVAL_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"trainer.v1.sampler.sampler_kwargs.poll_interval: must be a number of seconds > 0, "
                         f"got {value!r}")
    return float(value)


def replay_buffer(**kwargs: Any) -> Any:
    """verl's replay buffer for ``kwargs["trainer_mode"]`` with the poll interval of :func:`poll_interval_from`.

    Called by verl's trainer with the keyword arguments it gives a custom sampler (``trainer_mode``,
    ``trainer_config``, ``max_off_policy_threshold``, ``max_off_policy_strategy``, ``sampler_kwargs``,
    ``refill_fn``)."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    if "trainer_mode" not in kwargs:
        raise TypeError("replay_buffer: missing keyword argument 'trainer_mode' (verl's trainer passes it)")
    cls = ReplayBuffer if kwargs["trainer_mode"] == "sync" else ReplayBufferAsync
    return cls(**kwargs, poll_interval=poll_interval_from(kwargs.get("sampler_kwargs")))
