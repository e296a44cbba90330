from cluster.testing import ray_session  # noqa: F401  (the one Ray of the test session)
