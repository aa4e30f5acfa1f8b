"""Shared fixtures: one real Ray + TransferQueue session for every test that asks for it.

Tests import helper modules from this folder by their unique names (``verl_group_ppo_testutils_*``);
the folder is not a package, because verl and TransferQueue each install a top-level ``tests`` package.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

# CI runs the same hypothesis examples every time (reproducible); locally each run explores new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true"):
    settings.load_profile("ci")

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def ray_tq():
    """A local Ray (2 CPUs, no dashboard) with TransferQueue on one storage unit; closed at session end."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    if started_ray:
        ray.shutdown()
