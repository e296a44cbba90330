"""Python callables enqueued on a stream: on CUDA as host nodes (`cuLaunchHostFunc` / `cudaLaunchHostFunc`,
which a CUDA graph captures, unlike `cudaStreamAddCallback`), on CPU called in place, in the same order.

torch has no host-function API, so the driver's is called through ctypes. What that implies:
  - the callback is a ctypes CFUNCTYPE object: it must live as long as any graph that captured it
    (captured ones are kept for the launcher's lifetime; eager ones until `step_done`);
  - it runs on a CUDA driver thread and takes the GIL: the launching thread must never wait on the
    device while holding the GIL with a host function pending (torch's Stream.synchronize releases it;
    Tensor.tolist does not), or the two wait on each other (TensorRT-LLM hit exactly this);
  - it may call no CUDA API (so only CPU tensors, pinned or not), and an exception raised in it is
    lost to CUDA: it is kept here and raised by `check` after the step's sync.
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostFunctionError(RuntimeError):
    """A host function of the step failed; the step's outputs must not be used."""


def _launcher():
    """`cuLaunchHostFunc` of the CUDA driver (libcuda: one per process, whatever runtime torch links,
    statically or not), else `cudaLaunchHostFunc` of the runtime torch loaded. Same signature."""
    torch.cuda.init()
    try:
        return ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
    except (OSError, AttributeError):
        pass
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart" in line.rsplit("/", 1)[-1]})
    for path in [*paths, "libcudart.so", "libcudart.so.12", "libcudart.so.13"]:
        try:
            return ctypes.CDLL(path).cudaLaunchHostFunc
        except (OSError, AttributeError):
            continue
    raise HostFunctionError("cannot find cuLaunchHostFunc (libcuda) or cudaLaunchHostFunc (libcudart): "
                            "host functions need one")


class HostFunctions:
    def __init__(self, device: torch.device):
        self.device = device
        self.error: BaseException | None = None
        self._captured: list = []  # callbacks graphs hold: alive as long as this launcher (and its graphs)
        self._eager: list = []  # callbacks of eager launches: alive until the step's sync
        self._launch = None
        if device.type == "cuda":
            self._launch = _launcher()
            self._launch.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
            self._launch.restype = ctypes.c_int

    def launch(self, fn: Callable[[], None]) -> None:
        """Run `fn` when the stream reaches this point (in place on CPU)."""
        if self._launch is None:
            self._run(fn)
            return
        callback = _HOST_FN(lambda _user_data: self._run(fn))
        stream = torch.cuda.current_stream(self.device)
        (self._captured if torch.cuda.is_current_stream_capturing() else self._eager).append(callback)
        err = self._launch(ctypes.c_void_p(stream.cuda_stream), callback, None)
        if err != 0:
            raise HostFunctionError(f"launching a host function failed with CUDA error {err}")

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            # Inference mode is per thread: the step's buffers were made under it, and CUDA runs this on its
            # own driver thread, where an in-place write to them would raise outside it (seen on an H200).
            with torch.inference_mode():
                fn()
        except BaseException as e:  # noqa: BLE001 - CUDA would drop it; `check` raises it after the sync
            if self.error is None:
                self.error = e

    def sync(self) -> None:
        """Wait for the stream with the GIL released (so pending host functions can run), then `check`."""
        if self._launch is not None:
            torch.cuda.current_stream(self.device).synchronize()
            self._eager.clear()
        self.check()

    def check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise HostFunctionError(f"a host function of the step failed: {error!r}") from error
