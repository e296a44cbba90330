"""Inductor compilation for the CPU engine (EngineConfig.cpu_compile): one traced function with its
weights frozen in as constants, so inductor repacks every matmul's weight once for its CPU GEMM
micro-kernel and fuses the small ops around it.

Straight to inductor, without dynamo: the function is traced once with make_fx on example inputs
(Python control flow is resolved for those shapes, which the caller fixes), so a call checks no guards
and costs 1-2 us over the kernels. Users: packed GEMMs (engine/layers/packed_gemm.py) and piecewise
layers (engine/models/piecewise.py).

A compile that fails (no C++ compiler, an inductor limitation) turns compilation off for the process,
logged once; one whose outputs disagree with the eager function's on the example inputs is dropped
(logged). Either way the caller runs eagerly, as without cpu_compile.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable

import torch

log = logging.getLogger(__name__)


class _State:
    disabled: str | None = None  # why compilation is off for this process


# A function is being traced on this thread: matmuls as plain F.linear (engine/layers/linear.py). Per thread,
# so that a compile on one thread never changes what another's eager forward runs.
_local = threading.local()


def tracing() -> bool:
    return getattr(_local, "tracing", False)


@contextlib.contextmanager
def _tracing():
    _local.tracing = True
    try:
        yield
    finally:
        _local.tracing = False


def _outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def agrees(name: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], depth: int = 1) -> bool:
    """Whether a faster form's outputs on a probe equal the eager form's within float tolerance, which grows with the
    layers stacked (`depth`: rounding differences compound layer by layer); logged as an error where not."""
    if len(got) != len(want):
        log.error("%s returns %d outputs where its eager form returns %d; it stays eager", name, len(got), len(want))
        return False
    for g, w in zip(got, want):
        tol = (1e-2 if w.dtype in (torch.bfloat16, torch.float16) else 1e-4) * depth ** 0.5
        if w.is_floating_point():
            scale = float(w.float().abs().max().clamp(min=1)) if w.numel() else 1.0
            ok = g.shape == w.shape and torch.allclose(g.float(), w.float(), rtol=tol, atol=tol * scale)
        else:
            ok = torch.equal(g, w)
        if not ok:
            diff = float((g.float() - w.float()).abs().max()) if w.is_floating_point() and g.shape == w.shape else None
            log.error("%s disagrees with its eager form on a probe (max difference %s); it stays eager",
                      name, "n/a" if diff is None else f"{diff:.3g}")
            return False
    return True


def _reuse_gemm_templates() -> None:
    """Inductor renders each CPU GEMM it autotunes from a jinja template, and compiles the template's source again for
    every render: ~2,400 compiles of the same few sources in one SmolLM2-sized `layers` start-up, a third of its
    compile time (cProfile: jinja2 Environment.compile). A template compiled once renders any number of kernels, so
    the compiled form is kept per source. Only where torch has the hook this expects; otherwise nothing changes."""
    try:
        from torch._inductor.codegen.common import KernelTemplate
    except ImportError:
        return
    original = KernelTemplate.__dict__.get("_template_from_string")
    if not isinstance(original, staticmethod) or getattr(original.__func__, "tandem_cached", False):
        return
    compile_source = original.__func__
    cache: dict[str, object] = {}

    def cached(source: str):
        template = cache.get(source)
        if template is None:
            template = cache[source] = compile_source(source)
        return template

    cached.tandem_cached = True
    KernelTemplate._template_from_string = staticmethod(cached)


def compile_frozen(name: str, fn: Callable, examples: tuple[torch.Tensor, ...], depth: int = 1) -> Callable | None:
    """fn(*examples) -> tensor or tuple of tensors, compiled for exactly these input shapes and dtypes with
    every tensor it reads besides its inputs (weights) frozen; None: run fn eagerly. `depth`: the layers fn
    stacks, which the probe's tolerance grows with (rounding differences compound layer by layer)."""
    if _State.disabled is not None:
        return None
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    _reuse_gemm_templates()
    try:
        with torch.no_grad():
            with _tracing():
                gm = make_fx(fn)(*examples)
            # CPP alone: with ATen beside it inductor would time both and pick per run, which would make
            # a model's numerics depend on a benchmark's noise. No size/stride asserts per call: the callers pass
            # the traced shapes (PackedGemm and PiecewiseForward pad to their bucket), and in a whole forward the
            # asserts after each of its ~150 C++ ops' outputs cost ~2% of a batch-1 step (py-spy, SmolLM2).
            with config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP", size_asserts=False,
                              alignment_asserts=False, scalar_asserts=False):
                compiled = compile_fx(gm, list(examples))
            raw = fn(*examples)
            got, want = _outputs(compiled(*examples)), _outputs(raw)
    except Exception as e:  # no compiler, an inductor limitation: every later compile would fail alike
        _State.disabled = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("CPU compilation is off (%s, compiling %s); the engine runs eagerly", _State.disabled, name)
        return None
    if not agrees(f"compiled {name}", got, want, depth):
        return None
    single = not isinstance(raw, (tuple, list))

    def run(*args):
        out = compiled(*args)
        return out[0] if single and isinstance(out, (tuple, list)) else out

    return run
