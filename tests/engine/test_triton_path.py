"""A whole engine on the kernels' Triton paths (interpreted on this CPU, as a GPU runs them) against the same engine on
the torch references: the layers' fused kernels (rotary embedding fused into the KV store, the gated activation,
attention writing an uninitialised output) must give the reference's tokens and log-probabilities, with and without
a draft head (whose layer rotates its q and k the same way; MTP and EAGLE-3, whose two input norms and their
concatenation are one launch); for a Llama-family target and for an MLA + MoE one
(DeepSeek-V3 family: latent attention, routed and shared experts, its own MTP layer)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ['{"name": "', "The cat sat on", "JSON:"]

SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from engine import LLM, SamplingParams, SpecConfig
import kernels._dispatch as d
target, draft, eagle3, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
out = {"triton": d._TRITON_ON_CPU}
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
heads = [("mtp", draft), ("eagle3", eagle3)]
for name, spec in [("none", None)] + [(m, SpecConfig(method=m, k=2, draft=h)) for m, h in heads if h]:
    llm = LLM(target, num_kv_blocks=128, block_size=16, speculative=spec)
    res = llm.generate(prompts, params)
    out[name] = [[o.token_ids, [lp.logprob for lp in o.logprobs]] for o in res]
    out[name + "/accepted"] = [o.speculative.accepted_tokens if o.speculative else 0 for o in res]
print("RESULT " + json.dumps(out))
"""


def _run(target: str, draft: str, eagle3: str, triton: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TANDEM_TRITON_ON_CPU", None)
    if triton:
        env.update(TRITON_INTERPRET="1", TANDEM_TRITON_ON_CPU="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, target, draft, eagle3, json.dumps(PROMPTS)], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _check(target: str, draft: str, eagle3: str = "") -> None:
    ref, tri = _run(target, draft, eagle3, triton=False), _run(target, draft, eagle3, triton=True)
    assert tri["triton"] and not ref["triton"]
    names = ["none"] + [name for name, head in (("mtp", draft), ("eagle3", eagle3)) if head]
    for name in names:
        for (ref_ids, ref_lp), (tri_ids, tri_lp) in zip(ref[name], tri[name]):
            assert tri_ids == ref_ids, name
            assert max(abs(a - b) for a, b in zip(ref_lp, tri_lp)) < 1e-3, name
        assert [r[0] for r in tri[name]] == [r[0] for r in tri["none"]], name  # the head's drafts change no token
        # the tokens cannot tell a head's path (verification is lossless): its drafts, seen as what they accept, can
        assert tri[name + "/accepted"] == ref[name + "/accepted"], name


@pytest.mark.timeout(900)
def test_the_triton_path_gives_the_reference_paths_tokens_and_logprobs(zoo_dir):
    zoo = Path(zoo_dir)  # the writer target with its trained heads (target/, mtp/, eagle3/, ...)
    _check(str(zoo / "target"), str(zoo / "mtp"), str(zoo / "eagle3"))


@pytest.mark.timeout(900)
def test_the_triton_path_of_an_mla_moe_target(zoo_dir):
    """The zoo's tiny-moe (DeepSeek-V3 family): latent attention (its output uninitialised on the Triton path),
    routed and shared experts, and its MTP layer (in the target's directory)."""
    from zoo.models import resolve

    target = str(resolve("tandem-tiny-moe").target)
    _check(target, target)


@pytest.mark.timeout(900)
def test_the_triton_path_of_a_qwen3_target(tmp_path):
    """A random Qwen3 checkpoint saved by transformers: its per-head q/k RMS norm runs in the rotary-and-KV-store
    launch on the Triton path (kernels/norm_rope.py rope_store_kv's qk_norm), as separate norms on the reference
    path."""
    from tests.support.checkpoints import make_checkpoint

    make_checkpoint(tmp_path, "qwen3")
    _check(str(tmp_path), "")
