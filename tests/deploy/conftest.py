from cluster.testing import ray_session, tiny_model_dir  # noqa: F401
from deploy.testing import tandem_server  # noqa: F401
