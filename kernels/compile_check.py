"""Every kernel launch the engine makes, compiled to cubins for Ampere, Hopper and Blackwell without a GPU.

`python -m kernels.compile_check` (`make compile-check`) records the launches of kernels/compile_specs.py
for each target, turns each into the specialization Triton's launcher would compile (its own binder:
argument dtypes, 16-byte alignment, integers equal to 1 or divisible by 16, constexprs, num_warps), and
compiles each distinct one ahead of time with the wheel's ptxas (ptxas-blackwell for sm_90 and up).
It fails, naming kernel, specialization and target, on a wrapper that cannot launch an engine shape, a
compile error, shared memory over the target's per-block limit, or a register spill in a decode-path
kernel. Results are cached per (kernel source and dependencies, specialization, target, Triton version)
under ~/.cache/tandem/compile_check, so a warm run only records and binds.

Must run without TRITON_INTERPRET=1 (the interpreter replaces triton.jit, so nothing can be compiled);
tests/kernels/test_compile_check.py runs it in a subprocess for that reason.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import multiprocessing
import os
import re
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kernels.compile_report import TARGETS, Result, Target, write_report
from kernels.compile_specs import PUBLISHED, EngineSpace, Recorded, record, zoo_shapes


RECORD_VERSION = 2  # of the cached Result records
CACHE_DIR = Path(os.environ.get("TANDEM_COMPILE_CHECK_CACHE", Path.home() / ".cache" / "tandem" / "compile_check"))


@dataclass(frozen=True, slots=True)
class Spec:
    """One specialization: what Triton's launcher would hand to triton.compile."""

    kernel: object
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    scenario: str  # the first engine situation that launched it

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def label(self) -> str:
        """Constexprs by name, then each runtime argument's type (`/16`: specialized as divisible by 16)."""
        names = list(self.signature)
        consts = [f"{names[path[0]]}={value}" for path, value in self.constexprs.items()]
        runtime = []
        for i, (arg, ty) in enumerate(self.signature.items()):
            if ty != "constexpr":
                runtime.append(f"{arg}:{ty}{'/16' if self.attrs.get((i,)) else ''}")
        return f"{' '.join(consts)} | {' '.join(runtime)} | warps={self.options['num_warps']}"

    def key(self, target: Target) -> str:
        options = sorted((k, str(v)) for k, v in self.options.items())
        text = json.dumps([RECORD_VERSION, self.kernel.cache_key, self.label(), options, target.name,
                           triton.__version__])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------------ specs


def _binder(kernel, backend, cache: dict):
    if kernel not in cache:
        cache[kernel] = create_function_from_signature(kernel.signature, kernel.params, backend)
    return cache[kernel]


def specs_for(target: Target, space: EngineSpace) -> tuple[list[Spec], list[str]]:
    """(distinct specializations launched on `target`, scenarios whose wrapper could not launch)."""
    launches, failures = record(target.sm_count, zoo_shapes() + list(PUBLISHED), space)
    return bind_all(launches, target), failures


def bind_all(launches: list[Recorded], target: Target) -> list[Spec]:
    """The distinct specializations of `launches` on `target`. Each launch is bound as JITFunction.run binds
    it (same binder, same packing), so launches that would share a compiled kernel on a GPU share a spec."""
    backend = make_backend(GPUTarget("cuda", target.capability, 32))
    binders: dict = {}
    specs: dict[tuple, Spec] = {}
    for recorded in launches:
        kernel = recorded.launch.kernel
        kwargs = dict(recorded.launch.kwargs)
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        bound, specialization, options = _binder(kernel, backend, binders)(*recorded.launch.args, **kwargs)
        key = (kernel, tuple(specialization), tuple(sorted(options.items())))  # JITFunction.run's cache key
        if key not in specs:
            options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
            specs[key] = Spec(kernel, signature, constexprs, attrs, options.__dict__, recorded.scenario)
    return list(specs.values())


# ---------------------------------------------------------------------------------------- compile

_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): what a compile costs, whatever the load."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def compile_spec(spec: Spec, target: Target) -> Result:
    """Compile one specialization for `target`; registers and spills from ptxas's own report."""
    src = ASTSource(spec.kernel, spec.signature, spec.constexprs, spec.attrs)
    log = io.StringIO()
    start = _cpu_seconds()
    try:
        # Triton prints ptxas -v only when it runs ptxas: always compile (this module caches the results).
        with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.compilation.always_compile = True
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(src, target=GPUTarget("cuda", target.capability, 32), options=spec.options)
    except Exception as e:  # noqa: BLE001 - every compiler failure is a finding, reported by spec and target
        message = f"{type(e).__name__}: {e}".strip().splitlines()
        return Result(spec.name, spec.label(), target.name, spec.scenario, " / ".join(message[:6])[:2000],
                      _cpu_seconds() - start, 0, 0, 0, 0, target.smem_limit)
    elapsed = _cpu_seconds() - start
    text = log.getvalue()
    spills = _SPILLS.search(text)
    registers = _REGISTERS.search(text)
    if spills is None or registers is None:
        raise RuntimeError(f"no ptxas report for {spec.name} on {target.name}: {text[:500]!r}")
    return Result(spec.name, spec.label(), target.name, spec.scenario, None, elapsed, int(registers.group(1)),
                  int(spills.group(1)), int(spills.group(2)), compiled.metadata.shared, target.smem_limit)


def cached_result(spec: Spec, target: Target) -> Result | None:
    path = CACHE_DIR / f"{spec.key(target)}.json"
    return Result(**dict(json.loads(path.read_text()), cached=True)) if path.is_file() else None


def compile_and_store(spec: Spec, target: Target) -> Result:
    result = compile_spec(spec, target)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / f"{spec.key(target)}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(result)))
    tmp.replace(path)
    return result


# What forked workers compile, by index: JIT functions do not pickle, a forked child inherits them.
_PENDING: list[tuple[Spec, Target]] = []


def _compile_pending(i: int) -> Result:
    return compile_and_store(*_PENDING[i])


def compile_all(pending: list[tuple[Spec, Target]], jobs: int, progress=None) -> list[Result]:
    """Compile (and cache) every pending specialization, on `jobs` forked processes."""
    global _PENDING
    if jobs <= 1 or len(pending) <= 1:
        results = (compile_and_store(spec, target) for spec, target in pending)
    else:
        _PENDING = pending
        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
        results = pool.map(_compile_pending, range(len(pending)), chunksize=2)
    done = []
    try:
        for result in results:
            done.append(result)
            if progress is not None:
                progress(f"[{len(done)}/{len(pending)}] {result.kernel} {result.target} "
                         f"{result.compile_cpu_s:.2f} CPU s{' FAIL' if result.failure() else ''}")
    finally:
        if jobs > 1 and len(pending) > 1:
            pool.shutdown()
            _PENDING = []
    return done


# -------------------------------------------------------------------------------------------- main


def run(targets: tuple[Target, ...], space: EngineSpace, use_cache: bool, jobs: int = 1,
        progress=None) -> tuple[list[Result], list[str]]:
    """(a result per specialization and target, engine shapes a wrapper could not launch)."""
    results, pending, launch_failures = [], [], []
    for target in targets:
        specs, failures = specs_for(target, space)
        launch_failures += [f"{target.name}: {f}" for f in failures]
        for spec in specs:
            cached = cached_result(spec, target) if use_cache else None
            if cached is None:
                pending.append((spec, target))
            else:
                results.append(cached)
    return results + compile_all(pending, jobs, progress), launch_failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(t.name for t in TARGETS), help="comma-separated sm_XX")
    parser.add_argument("--no-cache", action="store_true", help="recompile everything (cold cost)")
    parser.add_argument("--report", type=Path, default=None,
                        help="write REPORT.md and REPORT.json (e.g. bench/results/compile_check)")
    parser.add_argument("-j", "--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="compiler processes (default: half the CPUs)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per compile")
    args = parser.parse_args(argv)
    if knobs.runtime.interpret:
        parser.error("TRITON_INTERPRET=1 replaces triton.jit with the interpreter: unset it to compile")
    wanted = args.targets.split(",")
    targets = tuple(t for t in TARGETS if t.name in wanted)
    if len(targets) != len(wanted):
        parser.error(f"unknown target in {wanted}; known: {[t.name for t in TARGETS]}")
    start = time.perf_counter()
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    space = EngineSpace()
    results, launch_failures = run(targets, space, not args.no_cache, args.jobs, progress)
    wall = time.perf_counter() - start
    cold = sum(r.compile_cpu_s for r in results)
    failures = [(r, r.failure()) for r in results if r.failure()]
    if args.report is not None:
        write_report(results, launch_failures, space, wall, args.jobs, args.report)
    cached = sum(r.cached for r in results)
    print(f"compile-check: {len(results)} compiles over {', '.join(t.name for t in targets)} "
          f"({cached} cached), {wall:.1f} s; uncached cost {cold:.0f} CPU s")
    for r, why in failures:
        print(f"FAIL {r.kernel} [{r.spec}] on {r.target}: {why} (from: {r.scenario})")
    for f in launch_failures:
        print(f"FAIL launch: {f}")
    return 1 if failures or launch_failures else 0


if __name__ == "__main__":
    sys.exit(main())
