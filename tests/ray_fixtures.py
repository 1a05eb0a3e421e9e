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
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
