"""The trainer's hand-over to the estimator, recorded: ``estimator_inputs`` as the GROUP-PPO trainer calls it, with
the group endpoints its value source fixed (``endpoints=``), and a check that the estimator's groups are exactly
those endpoints (it must not regroup the batch).
"""

from __future__ import annotations

import contextlib

import pytest
import torch


@pytest.fixture
def handed_endpoints(monkeypatch) -> list:
    """The ``endpoints`` argument of each ``estimator_inputs`` call the trainer makes, in order."""
    from verl_group_ppo.integration import trainer

    real = trainer.estimator_inputs
    handed: list = []

    @contextlib.contextmanager
    def recording(values, old_log_probs=None, threshold=None, endpoints=None, parent_nodes=None):
        handed.append(endpoints)
        with real(values, old_log_probs, threshold=threshold, endpoints=endpoints,
                  parent_nodes=parent_nodes) as inputs:
            yield inputs
        if endpoints is not None and inputs.outputs is not None:
            assert torch.equal(inputs.outputs.endpoint_mask, endpoints.bool()), "the estimator regrouped the batch"

    monkeypatch.setattr(trainer, "estimator_inputs", recording)
    return handed
