"""Draft trees through the kernels' Triton paths (interpreted on this CPU, as a GPU runs them): the fused expansion
(kernels/tree_expand.py), the draft passes' layout (draft_layout.py), the verification rows (tree_rows.py), the
acceptance table's update (tree_outcome.py), the accepted path's compaction (tree_accept.py), tree-masked attention
and the rest, in a whole engine. The engine's CPU path takes the torch references, so only this test runs those
kernels inside a step before a GPU does: each of their launches is checked against its reference on the same
in-engine inputs (real widths, grammar masks, the EAGLE-3
head's draft-to-target map), and outputs equal no speculation's, unguided and guided."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from engine import LLM, SamplingParams, SpecConfig, StructuredOutput
from zoo.corpus import heldout_cases
zoo = sys.argv[1]
schema = heldout_cases()[1]["schema"]
# short prompts: every row of the target runs through interpreted kernels here
prompts = ['{"name": "', "JSON:"]
params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0, structured_output=StructuredOutput(json_schema=schema))]
# every launch of the trees' fused kernels also runs its torch reference on the same inputs (copies of those it
# changes in place): they must agree
import kernels.draft_layout as dl, kernels.tree_accept as ta, kernels.tree_expand as te, kernels.tree_outcome as to
import kernels.tree_rows as tr, kernels.tree_walk as tw
names = ("expand", "choose", "draft_layout", "tree_rows", "outcome", "observe", "accept_path", "store_trees", "walk")
checks = dict({n: 0 for n in names}, mismatch=[])
def same(a, b):
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b))
    return torch.allclose(a, b, atol=1e-6, equal_nan=True) if a.is_floating_point() else torch.equal(a, b)
def copy(a):
    return tuple(copy(x) for x in a) if isinstance(a, tuple) else a.clone()
def checked(name, kernel, reference, mutated=()):
    def run(*args):
        ref_args = [copy(a) if i in mutated and a is not None else a for i, a in enumerate(args)]
        got, want = kernel(*args), reference(*ref_args)
        checks[name] += 1
        fields = getattr(want, "_fields", None) or [str(i) for i in range(len(want or ()))]
        pairs = list(zip(fields, want or (), got or ())) + [("arg%d" % i, ref_args[i], args[i]) for i in mutated
                                                             if args[i] is not None]
        checks["mismatch"] += [name + "." + f for f, a, b in pairs if a is not None and not same(a, b)]
        return got
    return run
te.expand_depth_triton = checked("expand", te.expand_depth_triton, te.expand_depth_ref, mutated=(14,))  # its columns
te.choose_triton = checked("choose", te.choose_triton, te.choose_ref)
dl.draft_layout_triton = checked("draft_layout", dl.draft_layout_triton, dl.draft_layout_ref)
tr.tree_rows_triton = checked("tree_rows", tr.tree_rows_triton, tr.tree_rows_ref)
to.outcome_triton = checked("outcome", to.outcome_triton, to.outcome_ref)
to.observe_triton = checked("observe", to.observe_triton, to.observe_ref, mutated=(0, 1, 2))
ta.accept_path_triton = checked("accept_path", ta.accept_path_triton, ta.accept_path_ref, mutated=(0,))
tr.store_trees_triton = checked("store_trees", tr.store_trees_triton, tr.store_trees_ref, mutated=(5, 6, 7, 8))
tw.walk_triton = checked("walk", tw.walk_triton, tw.walk_ref)
out = {}
for name, spec in [("none", None),
                   ("mtp", SpecConfig(method="mtp", k=3, draft=zoo + "/mtp", topk=3, num_verify_tokens=6)),
                   ("eagle3", SpecConfig(method="eagle3", k=3, draft=zoo + "/eagle3", topk=2, num_verify_tokens=5)),
                   ("chain", SpecConfig(method="mtp", k=3, draft=zoo + "/mtp"))]:  # its passes' layout: width 1
    llm = LLM(zoo + "/target", num_kv_blocks=256, block_size=16, speculative=spec)
    out[name] = [o.token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.stats().get("spec") or {}
    out[name + "_accepted"] = stats.get("mean_accepted_length")
    out[name + "_free"] = llm.engine.blocks.pool.num_used == 0
import kernels._dispatch as d
out["triton"] = d._TRITON_ON_CPU
out["checks"] = checks
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(900)
def test_trees_on_the_triton_path_equal_no_speculation(zoo):
    env = dict(os.environ, TRITON_INTERPRET="1", TANDEM_TRITON_ON_CPU="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(zoo)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["triton"]
    checks = out["checks"]
    assert not checks["mismatch"], checks
    assert checks["expand"] > 20
    assert min(checks[n] for n in ("choose", "draft_layout", "tree_rows", "accept_path", "store_trees", "walk")) > 5
    assert checks["outcome"] > 5 and checks["observe"] > 5, checks  # the trees were scored by the acceptance table
    for method in ("mtp", "eagle3", "chain"):
        assert out[method] == out["none"], method  # greedy, unguided and guided: the tokens of no speculation
        assert out[method + "_accepted"] > 1.0 and out[method + "_free"]
