"""engine/layers/linear.py: matvec_layout, the CPU weight layout chosen after loading."""
import torch

from engine.layers.linear import ColumnParallelLinear, RowParallelLinear, matvec_layout
from engine.layers.vocab import Embedding, LMHead
from engine.parallel import TPContext


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
