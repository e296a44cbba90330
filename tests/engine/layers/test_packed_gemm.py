"""engine/layers/packed_gemm.py: inductor-compiled GEMMs on prepacked weights for few-row CPU matmuls."""
import torch
import torch.nn.functional as F

from engine.layers.packed_gemm import PackedGemm, pack_cpu_gemms, warm_up
from tests.support.tiny_linear import TinyLinearModel


def test_packed_model_matches_eager_at_every_row_count():
    """Bucketed row counts (exact and zero-padded), the row-parallel bias added once, a tied head packed
    once; more rows than the largest bucket stay eager."""
    model = TinyLinearModel()
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
