"""Test support: one embedded Ray per test session, shared by every test package that needs it.

Each test folder's conftest imports `ray_session`. Pytest then holds one fixture per folder, so the
fixture counts its users: the first starts Ray, the last (at session end) shuts it down.
"""
from __future__ import annotations

import os
import tempfile

import pytest

from cluster.runtime import RayOptions, init_ray, shutdown_ray

_users = 0
TEST_NUM_CPUS = int(os.environ.get("TANDEM_TEST_RAY_CPUS", "8"))  # logical: actors mostly wait


@pytest.fixture(scope="session")
def ray_session():
    global _users
    import ray

    if _users == 0 and not ray.is_initialized():
        temp_dir = tempfile.mkdtemp(prefix="tandem-ray-")
        init_ray(RayOptions(num_cpus=TEST_NUM_CPUS, object_store_memory=128 * 2**20, temp_dir=temp_dir,
                            log_to_driver=True))
    _users += 1
    yield ray
    _users -= 1
    if _users == 0:
        shutdown_ray()
