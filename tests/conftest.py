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


@pytest.hookimpl(trylast=True)  # the move below: after pytest's own grouping by parametrized fixtures
def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none here)")
    skip_multi = pytest.mark.skip(reason=f"needs two or more CUDA devices ({n_gpu} here)")
    for item in items:
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(skip_gpu)
    moved = [item for item in items if _on_default_server(item)]
    if moved:
        rest = [item for item in items if not _on_default_server(item)]
        router = [n for n, item in enumerate(rest) if item.nodeid.startswith("tests/router/")]
        at = router[-1] + 1 if router else len(rest)
        items[:] = rest[:at] + moved + rest[at:]


# The cases on the default model's `tandem serve` (tests/support/served.py: DEFAULT_SERVER) run one after
# another, after the rest of tests/router, and the server stops after the last of them. Not held for the whole
# session: its processes run below pytest's, where tests/router/test_faults.py looks for the session's router
# replicas (a live second server there is a second router).
def _on_default_server(item) -> bool:
    return item.get_closest_marker("default_model_server") is not None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _on_default_server(item) and (nextitem is None or not _on_default_server(nextitem)):
        from tests.support.served import DEFAULT_SERVER

        DEFAULT_SERVER.close()


def pytest_sessionfinish(session):
    from tests.support.served import DEFAULT_SERVER

    DEFAULT_SERVER.close()  # an interrupted run


# `zoo_dir`: the default zoo, prebuilt under zoo/prebuilt/ (verified against its manifest; zoo/testing.py).
pytest_plugins = ["zoo.testing"]

# Fixtures shared by the serving tests (cluster, workers, router, deploy): one embedded Ray, one tiny
# checkpoint and one Tandem Serve application per session.
from cluster.testing import ray_session, tiny_model_dir  # noqa: E402,F401
from deploy.testing import tandem_server  # noqa: E402,F401
