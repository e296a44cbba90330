"""What a compile check reports: the GPU targets and their limits, one record per compiled specialization
and what makes it fail, and the written report (bench/results/compile_check.{md,json}).
kernels/compile_check.py produces the records."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import triton

from kernels.compile_specs import PUBLISHED, EngineSpace, zoo_shapes


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


@dataclass(frozen=True, slots=True)
class Result:
    """One specialization compiled for one target."""

    kernel: str
    spec: str
    target: str
    scenario: str
    error: str | None
    compile_cpu_s: float  # Triton and ptxas, CPU seconds
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


def summary_rows(results: list[Result]) -> list[dict]:
    """Per kernel and target: specializations, compile time, worst registers / spills / shared memory."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.kernel, r.target), []).append(r)
    rows = []
    for (kernel, target), rs in sorted(groups.items()):
        ok = [r for r in rs if r.error is None] or rs
        most_registers = max(ok, key=lambda r: r.registers)
        most_shared = max(ok, key=lambda r: r.shared)
        rows.append(dict(
            kernel=kernel, target=target, specs=len(rs), errors=len(rs) - len(ok),
            compile_cpu_s=sum(r.compile_cpu_s for r in rs), max_compile_cpu_s=max(r.compile_cpu_s for r in rs),
            max_registers=most_registers.registers, max_spill_bytes=max(r.spill_stores + r.spill_loads for r in ok),
            max_shared=most_shared.shared, smem_limit=rs[0].smem_limit,
            decode_path=kernel not in OFF_DECODE_PATH,
            most_registers_spec=most_registers.spec, most_shared_spec=most_shared.spec,
        ))
    return rows


def write_report(results: list[Result], launch_failures: list[str], space: EngineSpace, wall_s: float,
                 jobs: int, out: Path) -> None:
    """out.md and out.json: per kernel and target, and every failing specialization (all specializations:
    run the module with --report somewhere else; they are ~1 MB)."""
    failures = [(r, r.failure()) for r in results if r.failure()]
    rows = summary_rows(results)
    models = zoo_shapes() + list(PUBLISHED)
    cold_s = sum(r.compile_cpu_s for r in results)  # cached records keep what their compile took
    cached = sum(r.cached for r in results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(
        triton=triton.__version__, targets=[asdict(t) for t in TARGETS], models=[asdict(m) for m in models],
        space={k: [str(x) for x in v] if isinstance(v, tuple) else v for k, v in asdict(space).items()},
        compiles=len(results), cached=cached, wall_s=wall_s, jobs=jobs, compile_cpu_s=cold_s,
        launch_failures=launch_failures,
        failures=[dict(asdict(r), why=why) for r, why in failures], summary=rows,
    ), indent=1))
    lines = [
        "# Triton kernels compiled for GPU targets (no GPU)",
        "",
        f"`make compile-check`, Triton {triton.__version__}: {len(results)} compiles "
        f"({len({(r.kernel, r.spec) for r in results})} specializations of {len({r.kernel for r in results})} "
        f"kernels over {len(TARGETS)} targets), every launch of kernels/compile_specs.py's engine space. "
        f"Cold cost: {cold_s:.0f} CPU seconds of compiling (Triton and ptxas, summed over the compiles; "
        f"about that divided by -j in wall time on idle cores); this run: {wall_s:.0f} s wall on {jobs} "
        f"compiler processes, {cached} of {len(results)} compiles cached. Shared memory is per block, against the "
        f"target's opt-in limit; registers and spills are ptxas's report.",
        "",
        f"Engine space: models {', '.join(m.name for m in models)}; dtypes "
        f"{', '.join(str(d).removeprefix('torch.') for d in space.dtypes)}; KV block sizes {space.block_sizes}; "
        f"k = 0..{space.max_k}; decode batches {space.batches}; KV lengths {space.kv_lens}; prefill chunks of "
        f"{space.prefill_tokens} tokens; draft trees (tree-masked attention) up to topk {space.max_topk} and "
        f"{space.max_tree_nodes} nodes; tp=2 head slices for the hand-over.",
        "",
        f"Result: {'PASS' if not failures and not launch_failures else 'FAIL'}: {len(failures)} failing "
        f"specializations, {len(launch_failures)} engine shapes a wrapper could not launch.",
        "",
        "| kernel | target | specs | errors | compile CPU s (sum / max) | max regs | max spill B "
        "| max smem KiB / limit | decode path |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['kernel']} | {row['target']} | {row['specs']} | {row['errors']} | {row['compile_cpu_s']:.1f} / "
            f"{row['max_compile_cpu_s']:.2f} | {row['max_registers']} | {row['max_spill_bytes']} | "
            f"{row['max_shared'] / 1024:.1f} / {row['smem_limit'] // 1024} | {'yes' if row['decode_path'] else 'no'} |")
    if failures or launch_failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {r.kernel} on {r.target}: {why}; spec `{r.spec}` (from: {r.scenario})" for r, why in failures]
        lines += [f"- launch: {f}" for f in launch_failures]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
