"""Token embedding and LM head. Both are replicated on every tensor-parallel rank for now:
the zoo and small models keep the head tiny; a vocab-parallel head (all-gather of logits) is the
next step for 100k+ vocabularies at tp > 1."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import copy_checked, linear


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, shard_id=None) -> None:
        copy_checked(self.weight, tensor, name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(Embedding):
    weight_rows: torch.Tensor | None = None  # a row-major copy of a column-major weight (matvec_layout)
    packed = None  # PackedGemm when EngineConfig.cpu_compile is on

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, rows=self.weight_rows, packed=self.packed)
