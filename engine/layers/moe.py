"""Mixture of experts: the router (DeepSeek-V3's sigmoid scores with a correction bias and group-limited
top-k; softmax top-k), the routed experts as batched weights, and the block with its shared experts.

The experts run as two grouped GEMMs over the (token, choice) pairs sorted by expert (F.grouped_mm with
device-side group offsets; where that has no sync-free kernel, batched matmuls over each pair's gathered
expert weights): no Python loop over experts or tokens, no host sync and no shape that depends on the
routing, so a CUDA graph can capture it. Tensor parallelism shards every expert's intermediate dim
(and the shared experts'); the block returns its rank's partial sum and reduces once (under attention data
parallelism the group's row exchange reduces it, engine/distributed/data_parallel.py).

Expert parallelism (TPContext.expert_parallel) shards the routed experts instead: each rank holds
num_experts / N whole experts and computes, over the same rows, only the (token, choice) pairs routed to them;
the other pairs are sorted past its last group and never multiplied. The partial sums meet in the same one
reduction (an all-reduce, or under attention data parallelism the all-gather of rows before and the
reduce-scatter after: vLLM's and TensorRT-LLM's default dispatch), so the collectives per step stay fixed and
an idle rank stays safe. The shared experts stay sharded by their intermediate dim, each rank's slice summed once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config_mla import MoEConfig
from engine.distributed.data_parallel import DPContext
from engine.distributed.parallel import TPContext
from engine.errors import ModelLoadError
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear, copy_checked
from kernels.activation import silu_and_mul

EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")  # checkpoint names of an expert's weights, in shard-id order
GATHER_BYTES = 256 << 20  # the gathered form's bound on expert weights gathered at once


class TopKRouter(nn.Module):
    """x [T, H] -> (weights [T, K] fp32, expert ids [T, K] int64). Scores are computed in fp32 from an fp32
    gate whatever the model dtype (routing flips on rounding otherwise): as transformers keeps DeepSeek-V3's;
    for Qwen3-MoE, whose gate transformers runs in the model dtype, a bf16 model routes from exacter logits."""

    fp32_weights = True  # the loader hands them over uncast (engine/models/loader.py)

    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden), requires_grad=False)
        if moe.scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))
        else:
            self.e_score_correction_bias = None

    def load(self, name: str, tensor: torch.Tensor, shard_id=None) -> None:
        param = self.weight if name.endswith("weight") else self.e_score_correction_bias
        param.data = param.data.float()  # stays fp32 after the model was cast
        copy_checked(param, tensor.float(), name)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        if m.scoring == "softmax":
            scores = logits.softmax(-1)
            choice = scores
        else:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias  # the bias steers the choice, not the weights
        if m.n_group > 1 and m.topk_group < m.n_group:
            # A token picks its experts among its topk_group best groups, a group scored by its two best experts.
            T, per = choice.shape[0], m.num_experts // m.n_group
            grouped = choice.view(T, m.n_group, per)
            group_scores = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [T, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(m.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, m.num_experts)
        ids = choice.topk(m.top_k, dim=-1).indices  # [T, K]
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """This rank's experts' weights as two batched tensors: w13 [E_local, 2 * I_local, H] (gate rows, then up rows)
    and w2 [E_local, H, I_local]. Tensor parallelism: every expert (E_local = E), the slice I_local of each one's
    intermediate dim; expert parallelism: the experts first_expert .. first_expert + E_local, whole."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.intermediate = intermediate
        self.num_experts = num_experts
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        if self.expert_parallel:
            self.first_expert, local_experts = tp.shard(num_experts, "n_routed_experts")
            self.local = intermediate
        else:
            self.first_expert, local_experts = 0, num_experts
            _, self.local = tp.shard(intermediate, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(local_experts, 2 * self.local, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local_experts, hidden, self.local), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, shard_id: tuple[int, int]) -> None:
        """shard_id: (expert, part) with part an index into EXPERT_PARTS."""
        expert, part = shard_id
        E_local, _, H = self.w13.shape
        if not 0 <= expert < self.num_experts:
            raise ModelLoadError(f"weight {name!r} names expert {expert}, but the config has {self.num_experts} "
                                 f"routed experts")
        want = (self.intermediate, H) if part < 2 else (H, self.intermediate)
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {want}")
        local = expert - self.first_expert
        if not 0 <= local < E_local:  # another rank's expert (expert parallelism)
            return
        start, n = (0, self.intermediate) if self.expert_parallel else self.tp.shard(self.intermediate, name)
        if part < 2:  # gate or up [I, H]: this rank's rows, at the part's half of w13
            dst, src = self.w13.data[local].narrow(0, part * self.local, n), tensor.narrow(0, start, n)
        else:  # down [H, I]: this rank's columns
            dst, src = self.w2.data[local], tensor.narrow(1, start, n)
        copy_checked(dst, src, name)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, ids [T, K] -> this rank's partial sum over each token's experts [T, H]."""
        if x.shape[0] == 0:  # an ADP rank's idle forward: nothing to route (T is a host int, graphs stay fixed)
            return torch.zeros_like(x)
        if grouped_gemm_supported(x):
            return self._grouped(x, weights, ids)
        return self._gathered(x, weights, ids)

    def _local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T, K] -> (each pair's expert among this rank's [T * K], with E_local for another rank's; whether
        it is this rank's [T * K])."""
        E_local = self.w13.shape[0]
        flat = ids.reshape(-1) - self.first_expert
        mine = (flat >= 0) & (flat < E_local)
        return torch.where(mine, flat, E_local), mine

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Two grouped GEMMs over the (token, choice) pairs sorted by expert; under expert parallelism other
        ranks' pairs sort last, past the last group's offset: never multiplied, their rows dropped."""
        T, K = ids.shape
        E = self.w13.shape[0]
        flat, mine = self._local_ids(ids)  # [T * K] expert of each (token, choice) pair
        order = flat.argsort(stable=True)  # pairs grouped by expert
        counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))  # (bincount would read its max on the host)
        offsets = counts[:E].cumsum(0, dtype=torch.int32)  # [E] end of each expert's rows
        token = order // K  # [T * K] the token of each sorted pair
        h = F.grouped_mm(x.index_select(0, token), self.w13.transpose(1, 2), offs=offsets)  # [T * K, 2 * I_local]
        y = F.grouped_mm(silu_and_mul(h), self.w2.transpose(1, 2), offs=offsets)  # [T * K, H]
        y = y * weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype)
        if self.expert_parallel:  # rows past the last offset hold whatever the output's memory held
            y = torch.where(mine.index_select(0, order)[:, None], y, 0)
        return torch.zeros_like(x).index_add_(0, token, y)

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each pair's expert weights gathered, one batched matmul per projection: reads T * K experts' weights
        (what decode reads anyway; slow for long prefills), for devices and dtypes without a sync-free grouped
        GEMM. The pairs go in chunks whose gathered weights stay under GATHER_BYTES (a fixed count for a given
        T, so a captured graph holds the same chunks)."""
        T, K = ids.shape
        flat, mine = self._local_ids(ids)
        if self.expert_parallel:  # another rank's pair reads expert 0 and its weight is dropped
            flat, weights = flat.clamp(max=self.w13.shape[0] - 1), weights * mine.view(T, K)
        xs = x.repeat_interleave(K, dim=0)  # [T * K, H]
        per_pair = self.w13[0].numel() * self.w13.element_size()
        chunk = max(1, GATHER_BYTES // per_pair)
        parts = []
        for start in range(0, T * K, chunk):
            e = flat[start:start + chunk]
            h = torch.bmm(self.w13.index_select(0, e), xs[start:start + chunk, :, None])[..., 0]  # [c, 2 * I_local]
            parts.append(torch.bmm(self.w2.index_select(0, e), silu_and_mul(h)[:, :, None])[..., 0])  # [c, H]
        y = torch.cat(parts) if parts else xs.new_zeros(0, x.shape[1])
        return (y.view(T, K, x.shape[1]) * weights[:, :, None].to(y.dtype)).sum(1)


def grouped_gemm_supported(x: torch.Tensor) -> bool:
    """F.grouped_mm without a host sync: on CPU any float dtype, on CUDA bf16 (other CUDA dtypes take a
    fallback that reads the offsets on the host, which a captured graph cannot)."""
    return x.device.type == "cpu" or (x.device.type == "cuda" and x.dtype == torch.bfloat16)


class SharedExperts(nn.Module):
    """The always-on experts: one gated MLP, tensor-parallel, its reduction left to the block."""

    def __init__(self, hidden: int, intermediate: int, tp: TPContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class MoEBlock(nn.Module):
    """The MoE MLP of a layer: routed experts (+ shared experts). With `dp` (attention data parallelism) it
    runs over the whole group's rows, sharded over the group like the dense MLP (DPContext.mlp)."""

    def __init__(self, hidden: int, moe: MoEConfig, tp: TPContext, dp: DPContext | None = None):
        super().__init__()
        self.dp = dp
        self.tp = dp.mlp_tp if dp is not None else tp
        self.gate = TopKRouter(hidden, moe)
        self.experts = RoutedExperts(hidden, moe.intermediate_size, moe.num_experts, self.tp)
        self.shared_experts = (SharedExperts(hidden, moe.intermediate_size * moe.num_shared_experts, self.tp)
                               if moe.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp is not None:
            return self.dp.mlp(x, self._shard)
        return self.tp.all_reduce(self._shard(x))

    def _shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output over x [N, H]: routed plus shared, reduced once by the caller."""
        out = self.experts(x, *self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
