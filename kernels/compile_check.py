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
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kernels.compile_specs import PUBLISHED, EngineSpace, Recorded, record, zoo_shapes


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    capability: int
    sm_count: int  # the flagship part's SMs (A100, H100 SXM, B200): what split-KV sizes its grid to
    smem_limit: int  # bytes of shared memory one block may use (opt-in maximum)


TARGETS = (
    Target("sm_80", 80, 108, 163 * 1024),
    Target("sm_90", 90, 132, 227 * 1024),
    Target("sm_100", 100, 148, 227 * 1024),
)

# Kernels off the decode step (the KV hand-over runs once per request, on its own stream): a spill there
# is reported, not failed.
OFF_DECODE_PATH = frozenset({"_copy_blocks_kernel"})

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
        text = json.dumps([self.kernel.cache_key, self.label(), sorted((k, str(v)) for k, v in self.options.items()),
                           target.name, triton.__version__])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Result:
    kernel: str
    spec: str
    target: str
    scenario: str
    error: str | None
    compile_s: float
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared: int  # bytes of shared memory per block
    smem_limit: int
    cached: bool = False

    def failure(self) -> str | None:
        """Why this specialization fails the check, or None."""
        if self.error is not None:
            return f"compile error: {self.error}"
        if self.shared > self.smem_limit:
            return f"shared memory {self.shared} B > the {self.target} limit {self.smem_limit} B"
        if (self.spill_stores or self.spill_loads) and self.kernel not in OFF_DECODE_PATH:
            return f"register spill on the decode path ({self.spill_stores} B stored, {self.spill_loads} B loaded)"
        return None


# ------------------------------------------------------------------------------------------ specs


def _binder(kernel, backend, cache: dict):
    if kernel not in cache:
        cache[kernel] = create_function_from_signature(kernel.signature, kernel.params, backend)
    return cache[kernel]


def specs_for(target: Target, space: EngineSpace) -> tuple[list[Spec], list[str]]:
    """(distinct specializations launched on `target`, scenarios whose wrapper could not launch). Each launch
    is bound as JITFunction.run binds it (same binder, same packing), so two launches that would share a
    compiled kernel on a GPU share a spec here."""
    launches, failures = record(target.sm_count, zoo_shapes() + list(PUBLISHED), space)
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
    return list(specs.values()), failures


# ---------------------------------------------------------------------------------------- compile

_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def compile_spec(spec: Spec, target: Target) -> Result:
    """Compile one specialization for `target`; registers and spills from ptxas's own report."""
    src = ASTSource(spec.kernel, spec.signature, spec.constexprs, spec.attrs)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        # Triton prints ptxas -v only when it runs ptxas: always compile (this module caches the results).
        with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.compilation.always_compile = True
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(src, target=GPUTarget("cuda", target.capability, 32), options=spec.options)
    except Exception as e:  # noqa: BLE001 - every compiler failure is a finding, reported by spec and target
        message = f"{type(e).__name__}: {e}".strip().splitlines()
        return Result(spec.name, spec.label(), target.name, spec.scenario, " / ".join(message[:6])[:2000],
                      time.perf_counter() - start, 0, 0, 0, 0, target.smem_limit)
    elapsed = time.perf_counter() - start
    text = log.getvalue()
    spills = _SPILLS.search(text)
    registers = _REGISTERS.search(text)
    if spills is None or registers is None:
        raise RuntimeError(f"no ptxas report for {spec.name} on {target.name}: {text[:500]!r}")
    return Result(spec.name, spec.label(), target.name, spec.scenario, None, elapsed, int(registers.group(1)),
                  int(spills.group(1)), int(spills.group(2)), compiled.metadata.shared, target.smem_limit)


def cached_compile(spec: Spec, target: Target, use_cache: bool) -> Result:
    path = CACHE_DIR / f"{spec.key(target)}.json"
    if use_cache and path.is_file():
        return Result(**dict(json.loads(path.read_text()), cached=True))
    result = compile_spec(spec, target)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(result)))
    tmp.replace(path)
    return result


# ----------------------------------------------------------------------------------------- report


def summary_rows(results: list[Result]) -> list[dict]:
    """Per kernel and target: specializations, compile time, worst registers / spills / shared memory."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.kernel, r.target), []).append(r)
    rows = []
    for (kernel, target), rs in sorted(groups.items()):
        ok = [r for r in rs if r.error is None]
        rows.append(dict(
            kernel=kernel, target=target, specs=len(rs), errors=len(rs) - len(ok),
            compile_s=sum(r.compile_s for r in rs), max_compile_s=max(r.compile_s for r in rs),
            max_registers=max((r.registers for r in ok), default=0),
            max_spill_bytes=max((r.spill_stores + r.spill_loads for r in ok), default=0),
            max_shared=max((r.shared for r in ok), default=0), smem_limit=rs[0].smem_limit,
            decode_path=kernel not in OFF_DECODE_PATH,
        ))
    return rows


def write_report(results: list[Result], launch_failures: list[str], wall_s: float, cold_s: float,
                 out: Path) -> None:
    failures = [(r, r.failure()) for r in results if r.failure()]
    rows = summary_rows(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(
        triton=triton.__version__, targets=[asdict(t) for t in TARGETS], wall_s=wall_s, compile_s=cold_s,
        launch_failures=launch_failures, summary=rows, results=[asdict(r) for r in results],
    ), indent=1))
    lines = [
        "# Triton kernels compiled for GPU targets (no GPU)",
        "",
        f"`make compile-check`, Triton {triton.__version__}: {len(results)} compiles "
        f"({len({(r.kernel, r.spec) for r in results})} specializations of {len({r.kernel for r in results})} "
        f"kernels over {len(TARGETS)} targets), every launch of kernels/compile_specs.py's engine space. "
        f"Compile time if nothing were cached: {cold_s:.0f} s (sum of the compiles, one process); this run "
        f"{wall_s:.0f} s. Shared memory is per block, against the target's opt-in limit; registers and spills "
        f"are ptxas's report.",
        "",
        f"Result: {'PASS' if not failures and not launch_failures else 'FAIL'}: {len(failures)} failing "
        f"specializations, {len(launch_failures)} engine shapes a wrapper could not launch.",
        "",
        "| kernel | target | specs | errors | compile s (sum / max) | max regs | max spill B | max smem KiB / limit "
        "| decode path |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['kernel']} | {row['target']} | {row['specs']} | {row['errors']} | {row['compile_s']:.1f} / "
            f"{row['max_compile_s']:.2f} | {row['max_registers']} | {row['max_spill_bytes']} | "
            f"{row['max_shared'] / 1024:.1f} / {row['smem_limit'] // 1024} | {'yes' if row['decode_path'] else 'no'} |")
    if failures or launch_failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {r.kernel} on {r.target}: {why}; spec `{r.spec}` (from: {r.scenario})" for r, why in failures]
        lines += [f"- launch: {f}" for f in launch_failures]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


# -------------------------------------------------------------------------------------------- main


def run(targets: tuple[Target, ...], space: EngineSpace, use_cache: bool, progress=None) -> tuple[
        list[Result], list[str]]:
    results, launch_failures = [], []
    for target in targets:
        specs, failures = specs_for(target, space)
        launch_failures += [f"{target.name}: {f}" for f in failures]
        for i, spec in enumerate(specs):
            result = cached_compile(spec, target, use_cache)
            results.append(result)
            if progress is not None:
                progress(f"[{target.name} {i + 1}/{len(specs)}] {spec.name} {result.compile_s:.2f}s"
                         f"{' (cached)' if result.cached else ''}{' FAIL' if result.failure() else ''}")
    return results, launch_failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(t.name for t in TARGETS), help="comma-separated sm_XX")
    parser.add_argument("--no-cache", action="store_true", help="recompile everything (cold cost)")
    parser.add_argument("--report", type=Path, default=None,
                        help="write REPORT.md and REPORT.json (e.g. bench/results/compile_check)")
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
    results, launch_failures = run(targets, EngineSpace(), not args.no_cache, progress)
    wall = time.perf_counter() - start
    cold = sum(r.compile_s for r in results)
    failures = [(r, r.failure()) for r in results if r.failure()]
    if args.report is not None:
        write_report(results, launch_failures, wall, cold, args.report)
    cached = sum(r.cached for r in results)
    print(f"compile-check: {len(results)} compiles over {', '.join(t.name for t in targets)} "
          f"({cached} cached), {wall:.1f} s; uncached cost {cold:.0f} s")
    for r, why in failures:
        print(f"FAIL {r.kernel} [{r.spec}] on {r.target}: {why} (from: {r.scenario})")
    for f in launch_failures:
        print(f"FAIL launch: {f}")
    return 1 if failures or launch_failures else 0


if __name__ == "__main__":
    sys.exit(main())
