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
# the repository root: the demo (`experiments.demo`, not installed) and `benchmarks.stats` import from there
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)


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


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray (2 CPUs, no dashboard) for one test module, without TransferQueue; shut down after the module
    unless Ray was already running."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


# --------------------------------------------------------------------------------------------------
# Test tiers: `pytest -m "not slow"` is the quick loop. A test that starts Ray, a subprocess or main_ppo is
# marked slow; Ray users (through the ray_tq fixture) are marked here, and an unmarked test that starts a
# process fails, so the quick loop stays quick.

RAY_FIXTURES = ("ray_tq", "local_ray")


def pytest_sessionstart(session):
    # The standard library answers platform.processor() by running `uname -p` once per process and caching it;
    # verl asks for it on import of its engine workers. Asked here, so that whichever quick test first imports
    # verl does not count as starting a process.
    import platform

    platform.processor()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in RAY_FIXTURES):
            item.add_marker(pytest.mark.slow)
    items[:] = shared_ray_modules_last(items)


def shared_ray_modules_last(items: list) -> list:
    """``items`` with every module that uses the session's Ray (``ray_tq``) moved to the end, each module whole and
    in its own order (a module fixture is set up once). That Ray stays up until the session ends, and a process
    started beside it (a ``main_ppo`` run starts a dozen) runs slower: about 6 s of a 70 s run on 2 cores."""
    def module(item) -> str:
        return item.nodeid.split("::")[0]

    shared = {module(item) for item in items if "ray_tq" in getattr(item, "fixturenames", ())}
    return sorted(items, key=lambda item: module(item) in shared)  # stable: order kept within each part


@pytest.fixture(autouse=True)
def _quick_tests_start_no_process(request, monkeypatch):
    """Fail a test that is not marked slow but starts a subprocess or a multiprocessing worker."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    import multiprocessing.process
    import subprocess

    started: list[str] = []
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def recording_popen_init(self, args, *rest, **kwargs):
        started.append(f"subprocess {args!r}"[:200])
        return popen_init(self, args, *rest, **kwargs)

    def recording_process_start(self):
        started.append(f"multiprocessing worker {self.name}")
        return process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_popen_init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_process_start)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts {started[0]} but is not marked @pytest.mark.slow "
                    f"(tests/conftest.py: test tiers)", pytrace=False)
