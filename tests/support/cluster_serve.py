"""A local multi-node Ray cluster (deploy/local_cluster.py) and deploy/serve.yaml made tiny for it: the set-up
of tests/deploy/test_two_node.py."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import yaml

from deploy.local_cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]


def serve_config(model_dir: str, port: int, host: str = "127.0.0.1", api_key: str | None = None) -> dict:
    """deploy/serve.yaml as a user deploys it, with a tiny CPU model, small sizes and the proxy on host:port
    (with the API key in the app's runtime_env, as serve.yaml says to set it, when one is given)."""
    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    config["http_options"] = {"host": host, "port": port}
    (app,) = config["applications"]
    app["args"].pop("dtype")  # the checkpoint's (float32)
    app["args"].update(model=model_dir, device="cpu", prefill_replicas=1, max_num_seqs=8, num_kv_blocks=64,
                       max_num_batched_tokens=256, max_inflight=16, handover_timeout_s=15, connect_timeout_s=10)
    if api_key is not None:
        app["runtime_env"]["env_vars"]["TANDEM_API_KEY"] = api_key
    return config


@contextlib.contextmanager
def local_cluster(host: str = "127.0.0.1") -> Iterator[LocalCluster]:
    """A LocalCluster whose nodes are all stopped (and checked stopped) when the block exits; each node's
    command line and log tail are printed, for a failing test's report."""
    root = Path(tempfile.mkdtemp(prefix="tnd-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    local = LocalCluster(root, env={"PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}, host=host)
    try:
        yield local
    finally:
        for name, node in local.nodes.items():
            print(f"--- {name}: {' '.join(node.argv)}\n{node.log_tail()}")
        local.stop()
        left = [name for name, node in local.nodes.items() if node.alive()]
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"nodes still running after stop: {left}"


def attempt(fn):
    """fn(), or None while what it asks is not up yet."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - not up yet
        return None
