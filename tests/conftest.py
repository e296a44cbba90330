"""Session-wide test setup: markers that skip by hardware, Triton interpreter on CPU, thread limits."""
import os
import shutil
import subprocess

# The Triton interpreter must be chosen before triton is first imported; on a machine without a GPU
# every kernel test runs through it.
def _has_nvidia_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


if not _has_nvidia_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none here)")
    skip_multi = pytest.mark.skip(reason=f"needs two or more CUDA devices ({n_gpu} here)")
    for item in items:
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(skip_gpu)


# `zoo_dir`: the default zoo, prebuilt under zoo/prebuilt/ (verified against its manifest; zoo/testing.py).
pytest_plugins = ["zoo.testing"]

# Fixtures shared by the serving tests (cluster, workers, router, deploy): one embedded Ray, one tiny
# checkpoint and one Tandem Serve application per session.
from cluster.testing import ray_session, tiny_model_dir  # noqa: E402,F401
from deploy.testing import tandem_server  # noqa: E402,F401
