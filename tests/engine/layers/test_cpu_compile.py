"""engine/layers/cpu_compile.py: compiled CPU engines (packed GEMMs, piecewise layers) against the eager one."""
import pytest
import torch

from engine.layers import cpu_compile
from engine.layers.packed_gemm import PackedGemm, pack_cpu_gemms
from engine.layers.streamed_gemm import StreamedGemm
from kernels import cpu_ext
from tests.support.tiny_linear import TinyLinearModel


def test_a_failed_compile_leaves_every_matmul_eager(monkeypatch, caplog):
    """No C++ compiler (or any inductor error): logged once, the model keeps its eager outputs, and later
    weights do not try again."""
    from torch._inductor import compile_fx

    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compile_fx, "compile_fx", fail)
    monkeypatch.setattr(cpu_compile._State, "disabled", None)
    model = TinyLinearModel()
    pack_cpu_gemms(model)
    ids = torch.tensor([1, 2, 3])
    with caplog.at_level("WARNING"):
        torch.testing.assert_close(model(ids), model.reference(ids), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1 and "no C++ compiler" in caplog.text
    assert model.head.packed.kernels == {4: False}


@pytest.mark.slow
@pytest.mark.parametrize("mode,method", [("gemm", "mtp"), ("layers", "mtp"), ("layers", "eagle3"), ("full", "mtp"),
                                         ("full", "eagle3")])
def test_engine_compiled_on_cpu_matches_the_eager_engine(zoo_dir, mode, method):
    """The zoo target with a k=3 head, greedy: the same tokens as the eager engine and the same accepted
    lengths (so the same drafts: the hidden states the heads read, the last layer's for MTP and three
    captured ones for EAGLE-3, came out of the pieces right), and the compiled code carried the decode
    steps (gemm: packed GEMMs at 1 row in the draft chain and 4 rows to verify; layers: the target's
    pieces and the MTP head's, the LM head packed; full: each bucket of both one graph, attentions inside)."""
    from engine import LLM, SamplingParams, SpecConfig
    import zoo

    zoo_paths = zoo.layout(zoo_dir)
    spec = SpecConfig(method=method, k=3, draft=str(getattr(zoo_paths, method)))
    prompts = ["{\"name\": ", "def add(a, b):", "The capital of"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eager = LLM(str(zoo_paths.target), max_num_seqs=1, num_kv_blocks=64, block_size=16, speculative=spec)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    compiled = LLM(str(zoo_paths.target), max_num_seqs=1, num_kv_blocks=64, block_size=16, speculative=spec,
                   cpu_compile=mode)
    runner = compiled.engine.runner
    head = runner.model.lm_head.packed
    # "full": every matmul on one streamed copy (engine/layers/streamed_gemm.py)
    streamed = mode == "full" and cpu_ext.available()
    if streamed:
        assert isinstance(head, StreamedGemm) and runner.model.layers[0].mlp.down_proj.packed is not None
        if method == "mtp":
            assert runner.proposer.head.shared_head.head.packed is not None
    else:
        assert head is not None and head.kernels == {1: True, 4: True, 8: True, 16: True}  # compiled at start-up
    served = []
    kind = StreamedGemm if streamed else PackedGemm
    original = kind.__call__

    def counting(self, x):
        out = original(self, x)
        served.append(out is not None)
        return out

    kind.__call__ = counting
    try:
        got = [o.token_ids for o in compiled.generate(prompts, params)]
    finally:
        kind.__call__ = original
    assert got == want
    assert compiled.engine.stats()["spec"] == eager.engine.stats()["spec"]
    assert sum(served) > 30
    if mode in ("layers", "full"):
        target = runner.model.piecewise
        # Every bucket from start-up: none compiles mid-request. Whole graphs (streamed weights) add 2 rows: k=1 at
        # batch 1 pays 2 rows, not 4, and 32 rows the C++ stack op serves alone (engine/layers/streamed_gemm.py
        # STREAMED_BUCKETS): k=1 at batch 16 runs it, not the eager forward.
        every = {b: True for b in ((1, 2, 4, 8, 16, 32) if streamed else (1, 4, 8, 16))}
        assert target.buckets == every and target.runs > 10
        if method == "mtp":
            draft = runner.proposer.head.piecewise
            assert draft.buckets == every and draft.runs > 30
        assert (runner.model.layers[0].self_attn.qkv_proj.packed is None) != streamed  # inside a piece, or streamed
        whole = set(every) if mode == "full" and cpu_ext.available() else set()
        assert target.whole == whole and (method != "mtp" or runner.proposer.head.piecewise.whole == whole)
        # where whole graphs serve, the C++ stack op serves them (the MTP head's too: native_stack.native_mtp)
        assert target.native_buckets == whole and (method != "mtp" or draft.native_buckets == whole)
    else:
        assert runner.model.piecewise is None
        assert runner.model.layers[0].self_attn.qkv_proj.packed.kernels == {1: True, 4: True, 8: True, 16: True}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["layers", "full"])
def test_draft_trees_run_on_compiled_layers(zoo_dir, mode):
    """A tree's frontier states are one row expanded (stride 0 at batch 1); the pieces, traced with dense rows,
    take them made dense (they once failed inductor's stride check on the first expansion). Greedy tokens equal
    the eager engine without speculation, and the MTP head's pieces carried the expansions. "full": the tree's
    masks reach the attentions inside the graphs (the target verifies 6 rows, 8 with padding)."""
    from engine import LLM, SamplingParams, SpecConfig
    import zoo

    zoo_paths = zoo.layout(zoo_dir)
    prompts = ["{\"name\": ", "def add(a, b):"]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(zoo_paths.target), max_num_seqs=1, num_kv_blocks=64,
                                     block_size=16).generate(prompts, params)]
    spec = SpecConfig(method="mtp", k=3, topk=2, num_verify_tokens=5, draft=str(zoo_paths.mtp))
    tree = LLM(str(zoo_paths.target), max_num_seqs=1, num_kv_blocks=64, block_size=16, speculative=spec,
               cpu_compile=mode)
    assert [o.token_ids for o in tree.generate(prompts, params)] == want
    assert tree.engine.runner.proposer.head.piecewise.runs > 10
    if mode == "full" and cpu_ext.available():
        assert 8 in tree.engine.runner.model.piecewise.whole


@pytest.mark.skipif(not cpu_ext.available(), reason=f"C++ CPU kernels off: {cpu_ext.why_off()}")
def test_packing_a_net_beside_a_streamed_one(monkeypatch):
    """A net packed with inductor GEMMs next to one compiled "full" (an EAGLE-3 head beside its target) may share a
    streamed weight (the LM head): the packing keeps that StreamedGemm, warming up compiles nothing for it (it once
    raised AttributeError at start-up), and the model's outputs stay the reference's."""
    from engine.layers.packed_gemm import warm_up
    from engine.layers.streamed_gemm import stream_cpu_gemms

    monkeypatch.setattr(cpu_compile._State, "disabled", None)
    model = TinyLinearModel()
    streamed = {}
    stream_cpu_gemms(model.head, streamed)  # the "full" net streams the shared head
    pack_cpu_gemms(model)
    warm_up(model, (1, 4))
    assert isinstance(model.head.packed, StreamedGemm) and isinstance(model.up.packed, PackedGemm)
    for rows in (1, 3, 20):
        ids = torch.arange(rows) % 64
        torch.testing.assert_close(model(ids), model.reference(ids), rtol=1e-4, atol=1e-4)
