from cluster.testing import ray_session, tiny_model_dir  # noqa: F401
