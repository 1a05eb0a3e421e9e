"""One local Ray cluster per test module (starting Ray takes seconds; a cluster per test would dominate)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_cluster():
    """A 2-CPU-slot local Ray; worker processes can import the test helpers and run one thread each."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    from fuseflow.controller.ray_backend import start_local_ray

    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start_local_ray(2, env_vars={"PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
    yield ray
    ray.shutdown()
