"""The trainer's hand-over to the estimator, recorded: ``estimator_inputs`` as the GROUP-PPO trainer calls it, with
the group endpoints its value source fixed (``endpoints=``).

Where the estimator does not take ``endpoints`` yet, the recorder hands it the rest and checks that the groups the
estimator found are the endpoints the value source fixed, so the trainer's tests run either way.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch


@pytest.fixture
def handed_endpoints(monkeypatch) -> list:
    """The ``endpoints`` argument of each ``estimator_inputs`` call the trainer makes, in order."""
    from verl_group_ppo.integration import trainer

    real = trainer.estimator_inputs
    takes_endpoints = "endpoints" in inspect.signature(real).parameters
    handed: list = []

    @contextlib.contextmanager
    def recording(values, old_log_probs=None, threshold=None, endpoints=None):
        handed.append(endpoints)
        extra = {"endpoints": endpoints} if takes_endpoints else {}
        with real(values, old_log_probs, threshold=threshold, **extra) as inputs:
            yield inputs
        if endpoints is not None and inputs.outputs is not None:
            assert torch.equal(inputs.outputs.endpoint_mask, endpoints.bool()), "the estimator regrouped the batch"

    monkeypatch.setattr(trainer, "estimator_inputs", recording)
    return handed
