"""Tensor-parallel context of one engine process: its rank, the group size and the collectives.

tp_size == 1 makes every collective a no-op, so the single-process engine pays nothing for it.
The group is any torch.distributed ProcessGroup (NCCL on GPUs, gloo on CPUs) made by the caller; CPU ranks
of one host may also bring shared-memory collectives (engine/distributed/shm_collectives.py), which then carry every
all-reduce and all-gather that fits their slots (~100x cheaper than gloo's for a decode step's tensors).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup when size > 1
    shm: object | None = None  # ShmCollectives of the same ranks (CPU, one host), or None
    # MoE layers: routed experts sharded whole across the ranks (engine/layers/moe.py), not by intermediate dim
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.size > 1 and self.group is None:
            raise ValueError("tp_size > 1 needs a torch.distributed process group (tp_group)")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank {self.rank} out of range for tp_size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.shm is not None and self.shm.fits(x):
                return self.shm.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather_last_dim(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's contiguous slice of `total` units (heads, columns)."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tp_size={self.size}")
        per = total // self.size
        return self.rank * per, per


def kv_head_slice(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first KV head, count) held by `tp_rank`: contiguous slices, one replicated head per rank when
    there are more ranks than KV heads. The sharding rule of QKVParallelLinear and of the KV cache,
    which the hand-over also follows to send each decode rank its slice."""
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} and tp_size={tp_size} do not divide")
    local = max(1, num_kv_heads // tp_size)
    replicas = max(1, tp_size // num_kv_heads)
    return (tp_rank // replicas) * local, local
