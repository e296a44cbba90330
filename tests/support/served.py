"""`tandem serve` in a process of its own, with a Ray of its own, as a user starts it: the default model
(SmolLM2-135M-Instruct) for the slow conformance runs of the client-library suite (tests/router/conftest.py's
`served`) and tests/deploy/test_default_model.py (one server for both: `DEFAULT_SERVER`, see tests/conftest.py),
any model for tests/deploy/test_exposure.py."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ServeProcess:
    port: int
    pid: int  # the `tandem serve` process: its descendants are the whole deployment (embedded Ray included)
    startup: str  # what it printed until it served

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def tandem_serve(*flags: str, num_cpus: int = 4) -> Iterator[ServeProcess]:
    """`tandem serve FLAGS` until the block exits. Raises AssertionError with the server's last output lines if
    it does not come up. Ray's socket paths must fit in 107 bytes: its temp dir is a short one, not pytest's."""
    from cluster.rendezvous import free_port_on

    port = free_port_on("127.0.0.1")
    ray_tmp = tempfile.mkdtemp(prefix="tandem-serve-")
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", str(port),
                             "--num-cpus", str(num_cpus), *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "RAY_TMPDIR": ray_tmp})
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C stops serving") or "deployment failed" in line:
                break
        assert proc.poll() is None and lines and lines[-1].startswith("Ctrl-C"), "".join(lines[-40:])
        yield ServeProcess(port, proc.pid, "".join(lines))
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        shutil.rmtree(ray_tmp, ignore_errors=True)


@contextlib.contextmanager
def default_model_server(num_cpus: int = 4) -> Iterator[str]:
    """Serve the default model (no flags) until the block exits; yields its base URL."""
    with tandem_serve(num_cpus=num_cpus) as server:
        yield server.base_url


class DefaultModelServer:
    """The session's one `tandem serve` of the default model, for every case marked `default_model_server`
    (starting it is most of their cost): started by the first that asks, closed after the last; tests/conftest.py
    runs those cases one after another and closes it."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self.base_url: str | None = None

    def get(self) -> str:
        if self._stack is None:
            stack = contextlib.ExitStack()
            self.base_url = stack.enter_context(default_model_server())
            self._stack = stack
        return self.base_url

    def close(self) -> None:
        stack, self._stack, self.base_url = self._stack, None, None
        if stack is not None:
            stack.close()


DEFAULT_SERVER = DefaultModelServer()
