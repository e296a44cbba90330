"""engine/layers/weight_dtype.py: bf16 weights under fp32 arithmetic (EngineConfig.weight_dtype), against
transformers on the same rounded weights, and streamed from a bf16 copy under cpu_compile="full"."""
from __future__ import annotations

import copy

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.layers.weight_dtype import round_weights
from kernels import cpu_ext
from tests.engine.models.test_models import PROMPT, engine_logits


def _rounded(hf):
    """transformers' model with every matrix rounded to bf16, computing in fp32: llama.cpp's bf16 model."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.copy_(p.to(torch.bfloat16))
    return hf


def test_round_weights_rounds_matrices_once_and_keeps_norms():
    emb = torch.nn.Embedding(10, 6)
    net = torch.nn.ModuleDict({"emb": emb, "norm": torch.nn.LayerNorm(6), "head": torch.nn.Linear(6, 10, bias=False)})
    net["head"].weight = emb.weight  # tied: one tensor
    net["head"].weight_rows = torch.randn(10, 6)  # a row-major copy, as matvec_layout keeps
    norm = net["norm"].weight.detach().clone() + 0.123456789
    with torch.no_grad():
        net["norm"].weight.copy_(norm)
    before = emb.weight.detach().clone()
    assert round_weights([net, net["head"]], torch.bfloat16) == 2  # the tied matrix and the copy
    assert emb.weight.dtype == torch.float32
    assert torch.equal(emb.weight, before.to(torch.bfloat16).float()) and not torch.equal(emb.weight, before)
    assert torch.equal(net["head"].weight_rows, net["head"].weight_rows.to(torch.bfloat16).float())
    assert torch.equal(net["norm"].weight, norm)  # 1-D: stays fp32, as llama.cpp keeps norms


@pytest.mark.parametrize("chunks", [[15], [11, 1, 1, 1, 1]], ids=["prefill", "decode"])
def test_logits_equal_transformers_on_rounded_weights(checkpoints, chunks):
    path, hf = checkpoints["llama"]
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=4, weight_dtype="bfloat16"))
    with torch.no_grad():
        ref = _rounded(hf)(torch.tensor([PROMPT])).logits[0].float()
        plain = hf(torch.tensor([PROMPT])).logits[0].float()
    got = engine_logits(engine, PROMPT, chunks)
    assert got.dtype == torch.float32 and engine.runner.model.lm_head.weight.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-3  # the rounding is real: the unrounded model differs


def test_bad_weight_dtypes_are_typed_errors(checkpoints):
    path, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match="weight_dtype must be"):
        EngineConfig(model=path, weight_dtype="int8")
    with pytest.raises(ValueError, match="CPU option"):
        EngineConfig(model=path, device="cuda", weight_dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype='float32'"):
        LLMEngine(EngineConfig(model=path, num_kv_blocks=16, dtype="bfloat16", weight_dtype="bfloat16"))


@pytest.mark.slow
@pytest.mark.skipif(not cpu_ext.available(), reason="the C++ CPU kernels are off here")
def test_full_streams_bf16_copies_and_matches_the_eager_engine(zoo_dir, one_thread_module):
    """cpu_compile="full" with bf16 weights, the zoo target with its MTP head at k=3: every streamed matmul (the
    target's, the head's, the shared LM head) reads a bf16 copy; greedy tokens equal the eager engine's on the same
    rounded weights without speculation, logprobs within fp32 tolerance (both compute in fp32)."""
    import zoo
    from engine import SpecConfig

    paths = zoo.layout(zoo_dir)
    prompts = ["{\"name\": ", "def add(a, b):", "The capital of"]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    eager = LLM(str(paths.target), max_num_seqs=4, num_kv_blocks=64, block_size=16, weight_dtype="bfloat16")
    want = eager.generate(prompts, params)
    spec = SpecConfig(method="mtp", k=3, draft=str(paths.mtp))
    full = LLM(str(paths.target), max_num_seqs=4, num_kv_blocks=64, block_size=16, weight_dtype="bfloat16",
               cpu_compile="full", speculative=spec)
    runner = full.engine.runner
    packs = [runner.model.lm_head.packed, runner.model.layers[0].self_attn.qkv_proj.packed,
             runner.model.layers[-1].mlp.down_proj.packed, runner.proposer.head.shared_head.head.packed]
    assert all(p.pack.dtype == torch.bfloat16 for p in packs)
    assert runner.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # prefill's copy, rounded
    got = full.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in g.logprobs]),
                                   torch.tensor([lp.logprob for lp in w.logprobs]), rtol=1e-4, atol=1e-4)
    assert full.engine.stats()["spec"]["mean_accepted_length"] > 1  # drafts were accepted, not only verified
    from kernels import cpu_ext
    if cpu_ext.available():  # the head's block ran through the C++ stack op (engine/models/native_stack.py native_mtp)
        head = runner.proposer.head.piecewise
        assert head.native_buckets and head.native_buckets == head.whole and head.runs > 10
