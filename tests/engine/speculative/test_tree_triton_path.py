"""Draft trees through the kernels' Triton paths (interpreted on this CPU, as a GPU runs them): the fused expansion
(kernels/tree_expand.py), tree-masked attention and the rest, in a whole engine. The engine's CPU path takes the
torch references, so only this test runs the expansion's kernels inside a step before a GPU does: each of their
launches is checked against its reference on the same in-engine inputs (real widths, grammar masks, the EAGLE-3
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
# every launch of the fused expansion also runs its torch reference on the same inputs: they must agree
import kernels.tree_expand as te
checks = {"expand": 0, "choose": 0, "mismatch": []}
def checked(name, kernel, reference):
    def run(*args):
        got, want = kernel(*args), reference(*args)
        checks[name] += 1
        for field, a, b in zip(want._fields, want, got):
            if a is not None and not (torch.allclose(a, b, atol=1e-6) if a.is_floating_point() else torch.equal(a, b)):
                checks["mismatch"].append(name + "." + field)
        return got
    return run
te.expand_depth_triton = checked("expand", te.expand_depth_triton, te.expand_depth_ref)
te.choose_triton = checked("choose", te.choose_triton, te.choose_ref)
out = {}
for name, spec in [("none", None), ("mtp", SpecConfig(method="mtp", k=3, draft=zoo + "/mtp", topk=3, num_verify_tokens=6)),
                   ("eagle3", SpecConfig(method="eagle3", k=3, draft=zoo + "/eagle3", topk=2, num_verify_tokens=5))]:
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
    assert checks["expand"] > 20 and checks["choose"] > 5 and not checks["mismatch"], checks
    for method in ("mtp", "eagle3"):
        assert out[method] == out["none"], method  # greedy, unguided and guided: the tokens of no speculation
        assert out[method + "_accepted"] > 1.0 and out[method + "_free"]
