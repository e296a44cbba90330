"""`tandem serve` with no flags (the default model, SmolLM2-135M-Instruct) in a process of its own, with a Ray
of its own, as a user starts it: for the slow conformance runs of the client-library suite against the real
model (tests/router/conftest.py's `served`)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator

DEFAULT_MODEL = "smollm2-135m-instruct"


@contextlib.contextmanager
def default_model_server(num_cpus: int = 4) -> Iterator[str]:
    """Serve the default model until the block exits; yields its base URL (http://127.0.0.1:PORT). Raises
    AssertionError with the server's last output lines if it does not come up."""
    from cluster.rendezvous import free_port_on

    port = free_port_on("127.0.0.1")
    ray_tmp = tempfile.mkdtemp(prefix="tandem-default-")
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", str(port),
                             "--num-cpus", str(num_cpus)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "RAY_TMPDIR": ray_tmp})
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C stops serving") or "deployment failed" in line:
                break
        assert proc.poll() is None and lines and lines[-1].startswith("Ctrl-C"), "".join(lines[-40:])
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        shutil.rmtree(ray_tmp, ignore_errors=True)
