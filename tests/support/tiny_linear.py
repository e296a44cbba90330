"""A tiny model built of the engine's parallel linear layers (embedding, column- and row-parallel linears,
a tied head) with a plain-torch reference of its forward: for the CPU GEMM packing and compile tests."""
import torch
import torch.nn.functional as F

from engine.distributed.parallel import TPContext
from engine.layers.linear import ColumnParallelLinear, Embedding, LMHead, RowParallelLinear


class TinyLinearModel(torch.nn.Module):
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
