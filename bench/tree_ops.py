"""Kernels per decode step of chains and draft trees, and the tree expansion's share, counted on the CPU.

    python -m bench.tree_ops [--shapes 1x0,1x3,1x8,4x3,8x4,4x8,2x8] [--budget 8] [--triton] [--name NAME]

On a GPU at batch 1 a 135M model's step is launch-bound: with CUDA graphs every kernel is a graph node whose
launch and tail cost a few microseconds whatever its work, so a tree step that verifies as many rows as a chain
but launches more kernels is slower (bench/results/tree_vs_chain_cuda.md: trees accepted more and ran at
0.78-0.83x the chain of 3). This counts the aten calls of one eager decode step of the default real model
(SmolLM2-135M-Instruct and its MTP head, batch 1, greedy, unguided) that would launch a kernel: views, allocations
and calls that return one of their inputs unchanged (a `.to()` to the same dtype, `.contiguous()` of a contiguous
tensor) are left out; Triton launches of kernels/ are counted too. By default each kernel dispatcher takes its torch
reference on the CPU; `--triton` takes the Triton kernels (interpreted) and F.linear at every row count, as a GPU
does (the CPU's 2-8 row matmuls add a transposing copy, engine/layers/linear.py), which is the count that
stands for a GPU step (the fused tree kernels, kernels/tree_expand.py and tree_walk.py, are one launch each there).
The count for the whole step and for the expansion (engine/speculative/tree.py `expand`, the trees' drafting past
the head's first pass) is deterministic: a fact about the code, not the machine, which is why it can stand for a GPU
measurement until one runs. Shapes are TOPKxDEPTH; topk 1 is the chain of DEPTH, 1x0 a plain decode step (no
speculation).
Writes bench/results/{name}.{json,md}.
"""
from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# calls that launch no kernel: views and metadata, and allocations (a graph's memory pool holds them)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "t",
             "transpose", "permute", "alias", "detach", "as_strided", "split", "unbind", "_reshape_alias",
             "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view_as",
             "flatten", "unflatten", "split_with_sizes", "chunk", "narrow", "diagonal", "view_as_real"}


def _storages(x) -> set[int]:
    if isinstance(x, torch.Tensor):
        return {x.untyped_storage().data_ptr()}
    if isinstance(x, (list, tuple)):
        return set().union(*(_storages(v) for v in x)) if x else set()
    return set()


def _quiet_interpreter() -> None:
    """The Triton interpreter runs a kernel with torch ops of its own (copies in and out): those are the kernel's
    one launch, not calls of the step, so they run outside the count."""
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import _disable_current_modes

    grid = interpreter.GridExecutor
    if getattr(grid, "_tandem_quiet", False):
        return
    run = grid.__call__

    def quiet(self, *args, **kwargs):
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    grid.__call__, grid._tandem_quiet = quiet, True


class KernelCount(TorchDispatchMode):
    """Counts, by aten op name, the calls that would launch a kernel, and the Triton launches of kernels/ (as
    "triton:<kernel>"; they run only where a dispatcher takes Triton: `--triton` on the CPU)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self._launches = None

    def __enter__(self):
        from kernels._launch import counting

        _quiet_interpreter()
        self._launches = counting()
        self._launched = self._launches.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._launches.__exit__(*exc)
        self.calls.update(f"triton:{getattr(k, '__name__', None) or k.fn.__name__}" for k in self._launched)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in NO_KERNEL:
            return out
        # an out-of-place call that hands back an input's storage copied nothing (a no-op .to(), .contiguous())
        if not name.endswith("_") and _storages(out) & _storages(list(args) + list((kwargs or {}).values())):
            return out
        self.calls[name] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def gpu_kernels(step) -> int:
    """Kernels (and device copies and fills) the CUDA profiler sees while `step()` runs eagerly: the GPU's own count,
    what the dispatch count above stands for."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def count_shape(target: str, head: str, topk: int, depth: int, budget: int, prompt: str,
                device: str = "cpu") -> dict:
    """One steady-state decode step of the chain (topk 1) or tree, counted whole and in the expansion; on a GPU (eager:
    a graph would hide its kernels from the dispatch count) also by the CUDA profiler, on the next step."""
    import engine.speculative.tree as tree_mod
    from engine import LLM, SamplingParams, SpecConfig

    fields = dict(method="mtp", draft=head, k=depth)
    if topk > 1:
        fields.update(topk=topk, num_verify_tokens=max(depth, min(budget, topk * depth)))
    kw = dict(device=device, cuda_graphs=False, dtype="float32") if device == "cuda" else {}
    spec = SpecConfig(**fields) if depth else None  # 1x0: a plain decode step, every method's floor
    llm = LLM(target, max_num_seqs=1, num_kv_blocks=64, speculative=spec, **kw)
    engine = llm.engine
    expansions: list[KernelCount] = []
    original = tree_mod.expand

    def counted(*args, **kwargs):
        with KernelCount() as c:
            result = original(*args, **kwargs)
        expansions.append(c)
        return result

    tree_mod.expand = counted
    try:
        engine.add_request("count", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        for _ in range(4):  # past the prompt and the first drafts: a steady decode step
            engine.step()
        expansions.clear()
        with KernelCount() as step:
            engine.step()
        profiled = gpu_kernels(engine.step) if device == "cuda" else None
        engine.abort("count")
    finally:
        tree_mod.expand = original
    expansion = expansions[-1] if expansions else None
    return {"shape": f"{topk}x{depth}", "topk": topk, "depth": depth,
            "verified_nodes": fields.get("num_verify_tokens", depth) if depth else 0, "gpu_profiled_kernels": profiled,
            "step_kernels": step.total, "expansion_kernels": expansion.total if expansion else 0,
            "expansion_top": dict(expansion.calls.most_common(12)) if expansion else {}}


def table(rows: list[dict]) -> str:
    chain = {r["depth"]: r["step_kernels"] for r in rows if r["topk"] == 1}
    gpu = any(r.get("gpu_profiled_kernels") for r in rows)
    lines = ["| shape | verified nodes | kernels per step | of them the expansion | vs chain k=3 |"
             + (" CUDA profiler's kernels per step |" if gpu else ""), "|---|---|---|---|---|" + ("---|" if gpu else "")]
    for r in rows:
        label = ("no speculation" if not r["depth"] else f"chain k={r['depth']}" if r["topk"] == 1
                 else f"tree topk={r['topk']} depth={r['depth']}")
        ratio = f"{r['step_kernels'] / chain[3]:.2f}x" if 3 in chain else "-"
        lines.append(f"| {label} | {r['verified_nodes']} | {r['step_kernels']} | {r['expansion_kernels'] or '-'} "
                     f"| {ratio} |" + (f" {r.get('gpu_profiled_kernels')} |" if gpu else ""))
    return "\n".join(lines)


def main(argv=None) -> None:
    from bench.common import write_results
    from zoo.models import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x0,1x3,1x8,4x3,8x4,4x8,2x8", help="TOPKxDEPTH; 1x0: no speculation")
    ap.add_argument("--budget", type=int, default=8, help="nodes a tree verifies (at most topk x depth)")
    ap.add_argument("--name", default=None,
                    help="default tree_ops_cpu, tree_ops_triton_cpu with --triton, tree_ops_cuda on a GPU")
    ap.add_argument("--device", default="cpu", help="cuda: the step on a GPU (eager, fp32), also counted by the CUDA "
                                                   "profiler: whether the count stands for what a GPU launches")
    ap.add_argument("--triton", action="store_true",
                    help="the kernels' Triton paths on the CPU (interpreted), as a GPU runs them: the fused "
                         "expansion (kernels/tree_expand.py), attention, norms; slow, for counting only")
    args = ap.parse_args(argv)
    if args.triton:  # read when kernels/ and triton are first imported, which the engine does below
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["TANDEM_TRITON_ON_CPU"] = "1"
    torch.set_num_threads(1)
    if args.triton:  # 2-8 row matmuls take a transposed form with a copy on a CPU only (engine/layers/linear.py)
        import engine.layers.linear as linear_mod

        linear_mod.ROW_MAJOR_ROWS = range(0)
    paths = resolve("smollm2-135m-instruct")
    prompt = "Explain how a hash map handles collisions, with an example."
    rows = []
    for shape in args.shapes.split(","):
        topk, depth = (int(v) for v in shape.split("x"))
        rows.append(count_shape(str(paths.target), str(paths.heads["mtp"]), topk, depth, args.budget, prompt,
                                args.device))
        print(json.dumps(rows[-1]), flush=True)
    results = {"model": "smollm2-135m-instruct", "head": "mtp", "batch": 1, "budget": args.budget,
               "triton": args.triton, "device": args.device, "rows": rows}
    default = "tree_ops_cuda" if args.device == "cuda" else "tree_ops_triton_cpu" if args.triton else "tree_ops_cpu"
    print(write_results(args.name or default, results, table(rows)))


if __name__ == "__main__":
    main()
