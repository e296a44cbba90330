"""kernels/compile_check.py: every kernel launch compiled for sm_80/sm_90/sm_100 without a GPU, and the
recording (kernels/_launch.py) that derives what to compile from the wrappers themselves."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels._launch import multiprocessor_count, on_gpu, recording
from kernels.attention import paged_attention_triton
from kernels.compile_specs import EngineSpace, ModelShape, scenarios

ROOT = Path(__file__).resolve().parents[2]


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def _kernel_name(kernel) -> str:
    return kernel.fn.__name__


def test_recording_keeps_what_the_wrapper_would_launch():
    """One decode request over 32k positions on a pretend 132-SM GPU: split-KV, then the combine, with the
    GPU's rules (64-wide KV tiles, bf16 dots) although the tensors are meta tensors; nothing runs."""
    q = _meta(1, 9, 64, dtype=torch.bfloat16)
    cache = _meta(2049, 16, 3, 64, dtype=torch.bfloat16)
    with recording(sm_count=132) as rec:
        assert on_gpu(q) and multiprocessor_count(q.device) == 132
        paged_attention_triton(q, cache, cache, _meta(1, 2048, dtype=torch.int32), _meta(1, dtype=torch.int32),
                               _meta(2, dtype=torch.int32), 0.125, 1, 32768)
    assert not on_gpu(q), "the pretend GPU ends with the recording"
    attention, combine = rec.launches
    assert _kernel_name(attention.kernel) == "paged_attention_kernel"
    num_splits = attention.grid[2] // 3
    assert num_splits == 64 and attention.kwargs["SPLIT"] and attention.kwargs["BLOCK_N"] == 64
    assert not attention.kwargs["FP32_DOT"] and attention.kwargs["G"] == 3 and attention.kwargs["PAGE"] == 16
    assert _kernel_name(combine.kernel) == "combine_splits_kernel" and combine.kwargs["SPLITS_P2"] == 64


def test_every_launch_goes_through_launch():
    """A kernel launched as `kernel[grid](...)` would escape the recording, and so the compile check."""
    direct = []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\w\[\(.*\)\]\(", line) and "kernel[grid]" not in line:
                direct.append(f"{path.name}:{n}: {line.strip()}")
    assert not direct, direct


def _launched_kernels() -> set[str]:
    """Every kernel named as the first argument of a `launch(` call in kernels/."""
    names = set()
    for path in (ROOT / "kernels").glob("*.py"):
        names |= set(re.findall(r"launch\(\s*(?:_tr\.)?(\w+kernel)\b", path.read_text()))
    return names


def test_engine_space_is_the_engines():
    """EngineSpace keeps the engine's defaults so the check runs without importing the engine; this holds
    them equal."""
    from engine import EngineConfig
    from engine.config import MAX_K, MAX_TOPK, MAX_TREE_NODES

    fields = EngineConfig.__dataclass_fields__
    space = EngineSpace()
    assert space.block_sizes[0] == fields["block_size"].default
    assert space.prefill_tokens == fields["max_num_batched_tokens"].default
    assert space.max_k == MAX_K
    assert (space.max_topk, space.max_tree_nodes) == (MAX_TOPK, MAX_TREE_NODES)


def test_tree_launches_are_recorded():
    """Draft trees launch paged attention, and on MLA targets latent attention, with a tree mask (TREE): every
    frontier width and verified node count is in the check, beside the plain launches (issue 37's tree mask once
    spilled where nothing compiled it)."""
    models = [ModelShape("SmolLM2-135M", 576, 9, 3, 64, 49152)]
    space = EngineSpace(dtypes=(torch.bfloat16,), block_sizes=(16,), batches=(1,), kv_lens=(1000,))
    tree_rows = {"paged_attention_kernel": set(), "mla_attention_kernel": set()}
    for name, call in scenarios(models, space):
        if "tree" not in name or name.startswith("draft tree"):
            continue
        with recording(sm_count=132) as rec:
            call()
        attention, *combine = rec.launches  # split-KV adds the combine
        assert _kernel_name(attention.kernel) == ("mla_attention_kernel" if name.startswith("MLA")
                                                  else "paged_attention_kernel")
        assert attention.kwargs["TREE"]
        assert [_kernel_name(c.kernel) for c in combine] in ([], ["combine_splits_kernel"])
        tree_rows[_kernel_name(attention.kernel)].add((name.split(":")[0], int(re.search(r"q_len=(\d+)", name)[1])))
    want = set(range(2, space.max_tree_nodes + 2)) | {space.prefill_tokens}
    assert {q for _, q in tree_rows["paged_attention_kernel"]} == want
    shapes = {shape for shape, _ in tree_rows["mla_attention_kernel"]}
    assert len(shapes) == 2  # DeepSeek-V3's heads whole and under tp 8
    assert tree_rows["mla_attention_kernel"] == {(shape, q) for shape in shapes for q in want}


def test_tree_expansion_launches_are_recorded():
    """The fused expansion (kernels/tree_expand.py) at every width: each depth's kernel with and without the
    acceptance table and the draft-to-target map (the root's without parents), and the choice of nodes at every
    node-count block up to the most nodes."""
    space = EngineSpace()
    widths = set()
    for name, call in scenarios([ModelShape("SmolLM2-135M", 576, 9, 3, 64, 49152)], space):
        if not name.startswith("draft tree expansion"):
            continue
        with recording(sm_count=132) as rec:
            call()
        expand = [launch for launch in rec.launches if _kernel_name(launch.kernel) == "_expand_depth_kernel"]
        choose = [launch for launch in rec.launches if _kernel_name(launch.kernel) == "_choose_kernel"]
        assert len(expand) + len(choose) == len(rec.launches)
        K = expand[0].kwargs["K"]
        widths.add(K)
        assert {(e.kwargs["HAS_TABLE"], e.kwargs["HAS_REMAP"], e.kwargs["HAS_PARENT"]) for e in expand} == {
            (t, r, p) for t in (True, False) for r in (True, False) for p in (True, False)}
        # D, the path length, of (R, D, offset, own_shift, below, out_stride, out_col): 0 (the root) .. depth - 1
        assert {e.args[-6] for e in expand} == set(range(space.max_k))
        most = min(space.max_tree_nodes, K + (space.max_k - 1) * K * K)  # every candidate, at most 63 nodes
        assert max(c.kwargs["BLOCK_N"] for c in choose) == 1 << most.bit_length()  # and the root
    assert widths == set(range(2, space.max_topk + 1))


@pytest.mark.compile
@pytest.mark.timeout(3600)  # cold: every specialization compiled (see bench/results/compile_check.md)
def test_every_kernel_compiles_for_sm80_sm90_sm100(tmp_path):
    """The whole check, in a subprocess: this test run may have TRITON_INTERPRET=1, under which triton.jit
    gives interpreter functions that cannot be compiled. Warm (cached) it takes well under a minute."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TANDEM_TRITON_ON_CPU")}
    env["PYTHONPATH"] = str(ROOT)
    report = tmp_path / "compile_check"
    # every CPU: pytest only waits on this process meanwhile (cold, the compiles are most of the suite's time)
    jobs = str(os.cpu_count() or 1)
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--report", str(report), "--jobs", jobs],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    summary = json.loads(report.with_suffix(".json").read_text())["summary"]
    compiled = {row["kernel"] for row in summary}
    assert compiled == _launched_kernels(), "a kernel launched in kernels/ is missing from the check (or vice versa)"
    assert {row["target"] for row in summary} == {"sm_80", "sm_90", "sm_100"}


def _result(**kw):
    from kernels.compile_report import Result

    base = dict(kernel="paged_attention_kernel", spec="G=4 | q_ptr:*bf16", target="sm_80", scenario="s", error=None,
                compile_cpu_s=1.0, registers=128, spill_stores=0, spill_loads=0, shared=1024, smem_limit=163 * 1024)
    return Result(**dict(base, **kw))


def test_what_fails_the_check():
    assert _result().failure() is None
    assert "compile error" in _result(error="CompilationError: arange").failure()
    assert "shared memory 200704 B > the sm_80 limit" in _result(shared=196 * 1024).failure()
    assert "register spill on the decode path" in _result(spill_stores=8).failure()
    assert _result(kernel="_copy_blocks_kernel", spill_loads=8).failure() is None, "the hand-over only reports"


BROKEN = '''
import triton
import triton.language as tl


@triton.jit
def broken_kernel(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)  # the interpreter takes any N; the compiler wants a power of two
    tl.store(x_ptr + offs, tl.load(x_ptr + offs))
'''


@pytest.mark.compile
def test_a_compile_error_names_kernel_spec_and_target(tmp_path):
    """What the interpreter accepts and the compiler rejects fails the check with kernel, spec and target."""
    (tmp_path / "broken.py").write_text(BROKEN)
    script = (
        "import torch\n"
        "from broken import broken_kernel\n"
        "from kernels._launch import launch, recording\n"
        "from kernels.compile_check import TARGETS, bind_all, compile_spec\n"
        "from kernels.compile_specs import Recorded\n"
        "with recording(132) as rec:\n"
        "    launch(broken_kernel, (1,), torch.empty(48, device='meta'), N=48)\n"
        "(spec,) = bind_all([Recorded('broken', rec.launches[0])], TARGETS[1])\n"
        "r = compile_spec(spec, TARGETS[1])\n"
        "print(r.kernel, r.target, r.spec, r.failure(), sep='\\n')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TANDEM_TRITON_ON_CPU")}
    env["PYTHONPATH"] = f"{ROOT}:{tmp_path}"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernel, target, spec, why = proc.stdout.strip().splitlines()[-4:]
    assert (kernel, target) == ("broken_kernel", "sm_90") and spec.startswith("N=48 | x_ptr:*fp32/16")
    assert why.startswith("compile error") and "power of 2" in why, why
