"""A child process for work that must be stoppable: grammar compiles (xgrammar has no timeout, and a
thread cannot be stopped, so an over-time compile is ended by killing its process).

The child is a fresh interpreter running `serve()`, started with subprocess, never with multiprocessing:
spawn would re-run the parent's `__main__` (a user script without an `if __name__ == "__main__"`
guard loads its model again, or hangs), and fork would copy the parent's locked threads. Calls travel
as length-prefixed pickles over the child's stdin/stdout: first `(init, init_args)`, whose result is
the child's state, then `(fn, args)` per call, answered with `(ok, value)`. `init` and `fn` must be
module-level functions (pickled by reference, imported by the child).
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from typing import Callable

_LEN = struct.Struct("<Q")


class WorkerTimeout(Exception):
    """The call ran past its limit; its process was ended."""


class WorkerFailed(Exception):
    """The call raised in the child (`kind` is the exception's type name), or the child could not
    start (`WorkerStartup`) or died (`WorkerDied`)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _write(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def _read(stream):
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the other side closed the pipe")
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the other side closed the pipe")
    return pickle.loads(data)


class CompileWorker:
    """One child process running calls one at a time. A call past its timeout kills the process; the
    next call starts a fresh one (start-up is not counted against a call's timeout)."""

    def __init__(self, init: Callable | None = None, init_args: tuple = ()):
        self._init, self._init_args = init, init_args
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self, startup_timeout: float) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-c", "from structured.compile_worker import serve; serve()"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        _write(self._proc.stdin, (self._init, self._init_args))
        self._answer(startup_timeout, "WorkerStartup")

    def _answer(self, timeout: float, failure: str):
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            if failure == "WorkerStartup":
                raise WorkerFailed(failure, f"the compile process did not start within {timeout:g} s")
            raise WorkerTimeout(f"no result within {timeout:g} s")
        try:
            ok, value = _read(self._proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as e:  # it died (out of memory, a crash in C++)
            self.close()
            raise WorkerFailed(failure if failure == "WorkerStartup" else "WorkerDied",
                               f"the compile process died: {e}") from e
        if not ok:
            raise WorkerFailed(*value)
        return value

    def call(self, fn: Callable, *args, timeout: float, startup_timeout: float = 120.0):
        """fn(state, *args) in the child; WorkerTimeout past `timeout` seconds, WorkerFailed if it raised."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.close()
                self._start(startup_timeout)
            try:
                _write(self._proc.stdin, (fn, args))
            except (BrokenPipeError, OSError) as e:
                self.close()
                raise WorkerFailed("WorkerDied", f"the compile process died: {e}") from e
            return self._answer(timeout, "WorkerDied")

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=5)
            for stream in (self._proc.stdin, self._proc.stdout):
                stream.close()
            self._proc = None

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass


def serve() -> None:
    """The child's loop (its stdin/stdout are the parent's pipes)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the answer stream
    state = None
    try:
        init, init_args = _read(stdin)
        state = init(*init_args) if init is not None else None
        _write(stdout, (True, "ready"))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises WorkerStartup
        _write(stdout, (False, ("WorkerStartup", f"{type(e).__name__}: {e}")))
        return
    while True:
        try:
            fn, args = _read(stdin)
        except EOFError:
            return
        try:
            _write(stdout, (True, fn(state, *args)))
        except Exception as e:  # noqa: BLE001 - exceptions may not unpickle in the parent: send their text
            _write(stdout, (False, (type(e).__name__, str(e))))
