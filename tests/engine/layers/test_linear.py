"""engine/layers/linear.py: matvec_layout, the CPU weight layout chosen after loading."""
import torch

from engine.distributed.parallel import TPContext
from engine.layers.linear import ColumnParallelLinear, Embedding, LMHead, RowParallelLinear, matvec_layout


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.wide = ColumnParallelLinear(8, 24, True, TPContext())  # more outputs than inputs
        self.narrow = RowParallelLinear(24, 8, False, TPContext())
        self.embed = Embedding(32, 8)
        self.head = LMHead(32, 8)
        self.head.weight = self.embed.weight  # tied, as with tie_word_embeddings
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, ids):
        return self.head(self.narrow(self.wide(self.embed(ids))))


def test_matvec_layout_keeps_values_and_ties():
    """Wide weights become column-major (W^T contiguous), narrow ones stay row-major; shapes, values,
    the tie between embedding and LM head, and the model's outputs do not change; a second call is a
    no-op (a double transpose would undo the first)."""
    model = Tiny()
    ids = torch.tensor([3, 0, 31, 7])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = model(ids)
    for _ in range(2):
        matvec_layout(model)
        assert model.wide.weight.shape == (24, 8) and model.wide.weight.t().is_contiguous()
        assert model.narrow.weight.is_contiguous()
        assert model.embed.weight.shape == (32, 8) and model.embed.weight.t().is_contiguous()
        assert model.head.weight is model.embed.weight
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
        torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=1e-5)


def test_row_major_copies_for_few_rows_within_budget():
    """With a budget, each weight made column-major keeps a row-major copy that `linear` uses for 2-8 rows
    (speculation's verification rows at batch 1-2); outputs equal the one-layout model's for 1 to 12 rows;
    past the budget no copy is kept at all."""
    from engine.layers.linear import linear

    model, plain = Tiny(), Tiny()
    matvec_layout(plain)
    kept = matvec_layout(model, rows_budget_bytes=1 << 20)
    assert kept == (24 * 8 + 32 * 8) * 4  # the wide linear and the (tied) LM head
    assert model.wide.weight_rows.is_contiguous() and torch.equal(model.wide.weight_rows, model.wide.weight)
    assert model.head.weight_rows is not None and model.narrow.weight_rows is None
    for rows in (1, 2, 4, 8, 12):
        ids = torch.arange(rows) % 32
        torch.testing.assert_close(model(ids), plain(ids), atol=1e-5, rtol=1e-5)
        x = torch.randn(rows, 8)
        torch.testing.assert_close(linear(x, model.wide.weight, model.wide.bias, model.wide.weight_rows),
                                   torch.nn.functional.linear(x, model.wide.weight, model.wide.bias))
    small = Tiny()
    assert matvec_layout(small, rows_budget_bytes=100) == 0 and small.wide.weight_rows is None
