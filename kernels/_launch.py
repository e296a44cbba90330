"""Every Triton launch of kernels/ goes through `launch`, so the compile check sees exactly what runs.

A wrapper decides its grid, constexprs and launch options from its tensors and from a few device facts
(is it a GPU, how many multiprocessors). Inside `recording(...)` those facts come from the recording's
pretend GPU instead of the tensors' device, and `launch` records the call instead of running it. The
compile check (kernels/compile_check.py) calls the wrappers with meta tensors under a recording and
compiles what they would have launched: the specializations come from the launch code itself, so a
new launch shape cannot escape the check. Outside a recording nothing changes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch as a wrapper would make it."""

    kernel: object  # the @triton.jit function
    grid: tuple[int, ...]
    args: tuple  # positional arguments (tensors and scalars)
    kwargs: dict  # constexprs passed by name and launch options (num_warps, ...)


@dataclass(slots=True)
class Recording:
    """A pretend GPU: launches made inside `recording` land in `launches`."""

    sm_count: int  # multiprocessors, for the wrappers that size their grid to the device
    launches: list[Launch] = field(default_factory=list)


_RECORDING: ContextVar[Recording | None] = ContextVar("tandem_kernel_recording", default=None)


@contextlib.contextmanager
def recording(sm_count: int) -> Iterator[Recording]:
    """Record launches instead of running them, as if the tensors were on a GPU with `sm_count` SMs."""
    rec = Recording(sm_count)
    token = _RECORDING.set(rec)
    try:
        yield rec
    finally:
        _RECORDING.reset(token)


_COUNTING: ContextVar[tuple[list, ...]] = ContextVar("tandem_kernel_counting", default=())


@contextlib.contextmanager
def counting() -> Iterator[list]:
    """Run launches as usual and list the kernel of each (bench/tree_ops.py counts a step's launches). Counts nest:
    a launch is listed in every enclosing count (a step's count includes its expansion's, counted on its own too)."""
    kernels: list = []
    token = _COUNTING.set(_COUNTING.get() + (kernels,))
    try:
        yield kernels
    finally:
        _COUNTING.reset(token)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, or recorded inside `recording`."""
    rec = _RECORDING.get()
    if rec is None:
        kernel[grid](*args, **kwargs)
        for counted in _COUNTING.get():
            counted.append(kernel)
    else:
        rec.launches.append(Launch(kernel, tuple(grid), args, dict(kwargs)))


def on_gpu(t: torch.Tensor) -> bool:
    """Whether launch decisions for `t` follow the GPU rules (a CUDA tensor, or any tensor under a recording)."""
    return t.is_cuda or _RECORDING.get() is not None


_SM_COUNT: dict[int, int] = {}


def multiprocessor_count(device: torch.device) -> int:
    """SMs of `device` (a CUDA device; the pretend GPU's under a recording)."""
    rec = _RECORDING.get()
    if rec is not None:
        return rec.sm_count
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
