"""engine/layers/packed_gemm.py: inductor-compiled GEMMs on prepacked weights for few-row CPU matmuls."""
import pytest
import torch
import torch.nn.functional as F

from engine.layers import packed_gemm
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.packed_gemm import PackedGemm, pack_cpu_gemms, warm_up
from engine.layers.vocab import Embedding, LMHead
from engine.parallel import TPContext


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = ColumnParallelLinear(32, 96, True, TPContext())
        self.down = RowParallelLinear(96, 32, True, TPContext())  # its bias comes after the (trivial) reduce
        self.embed = Embedding(64, 32)
        self.head = LMHead(64, 32)
        self.head.weight = self.embed.weight  # tied
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, ids):
        return self.head(self.down(self.up(self.embed(ids))))

    def reference(self, ids):
        x = F.linear(self.embed.weight[ids], self.up.weight, self.up.bias)
        x = F.linear(x, self.down.weight) + self.down.bias
        return F.linear(x, self.embed.weight)


def test_packed_model_matches_eager_at_every_row_count():
    """Bucketed row counts (exact and zero-padded), the row-parallel bias added once, a tied head packed
    once; more rows than the largest bucket stay eager."""
    model = Tiny()
    assert pack_cpu_gemms(model) == 3  # up, down, the head (the embedding is a lookup)
    assert pack_cpu_gemms(model) == 3  # idempotent
    warm_up(model, (1, 4))
    assert model.up.packed.kernels == {1: True, 4: True}
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 3, 4, 17):
            ids = torch.randint(0, 64, (rows,), generator=gen)
            torch.testing.assert_close(model(ids), model.reference(ids), rtol=1e-4, atol=1e-4)
    buckets = model.down.packed.kernels
    assert buckets == {1: True, 4: True}, buckets  # 3 rows ran padded to 4; 17 never compile


def test_packed_gemm_serves_its_rows_and_declines_others():
    w, b = torch.randn(48, 16), torch.randn(48)
    packed = PackedGemm(w, b, "w")
    x = torch.randn(2, 16)
    torch.testing.assert_close(packed(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert packed(torch.randn(17, 16)) is None  # past the largest bucket
    assert packed(torch.randn(2, 16, dtype=torch.float64)) is None  # another dtype than the weight's


def test_a_failed_compile_leaves_every_matmul_eager(monkeypatch, caplog):
    """No C++ compiler (or any inductor error): logged once, the model keeps its eager outputs, and later
    weights do not try again."""
    from torch._inductor import compile_fx

    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compile_fx, "compile_fx", fail)
    monkeypatch.setattr(packed_gemm._Disabled, "reason", None)
    model = Tiny()
    pack_cpu_gemms(model)
    ids = torch.tensor([1, 2, 3])
    with caplog.at_level("WARNING"):
        torch.testing.assert_close(model(ids), model.reference(ids), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1 and "no C++ compiler" in caplog.text
    assert model.head.packed.kernels == {4: False}


@pytest.mark.slow
def test_engine_with_packed_gemms_matches_the_eager_engine(zoo_dir):
    """The zoo target with MTP k=3, greedy: the same tokens as the eager engine, and the packed kernels
    carried the decode steps' matmuls (1 row: draft chain; 4 rows: verification)."""
    import zoo
    from engine import LLM, SamplingParams, SpecConfig

    zoo_paths = zoo.layout(zoo_dir)
    spec = SpecConfig(method="mtp", k=3, draft=str(zoo_paths.mtp))
    prompts = ["{\"name\": ", "def add(a, b):", "The capital of"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eager = LLM(str(zoo_paths.target), max_num_seqs=1, num_kv_blocks=64, block_size=16, speculative=spec)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    packed = LLM(str(zoo_paths.target), max_num_seqs=1, num_kv_blocks=64, block_size=16, speculative=spec,
                 cpu_packed_gemm=True)
    qkv = packed.engine.runner.model.layers[0].self_attn.qkv_proj.packed
    assert qkv is not None and qkv.kernels == {1: True, 4: True}
    served = []
    original = PackedGemm.__call__

    def counting(self, x):
        out = original(self, x)
        served.append(out is not None)
        return out

    PackedGemm.__call__ = counting
    try:
        got = [o.token_ids for o in packed.generate(prompts, params)]
    finally:
        PackedGemm.__call__ = original
    assert got == want
    assert sum(served) > 100
