"""Attention data parallelism (ADP) inside one engine process: the row exchange around the MLP and the
per-step lockstep agreement of the group.

Under ADP the `size` ranks of a group each run attention for their own requests (full attention
weights, whole-head KV), while the MLP stays tensor-parallel across the group. Around every MLP the
ranks trade rows: each pads its [T_r, H] hidden states to the group's row count P, all-gathers them
into [size * P, H], runs its MLP shard on every rank's rows, and gets its own P rows back summed over
the shards. Two ways to get them back (`exchange`):
- "reduce_scatter" (default): one reduce-scatter of [size * P, H] -> [P, H]. A ring reduce-scatter moves
  (size-1)/size of the buffer per rank: half the bytes of an all-reduce of the same buffer.
- "all_reduce": all-reduce [size * P, H] on every rank and keep its own P rows (what the row-parallel
  layer of plain TP already does). On gloo (CPU) three runs of bench/adp.py put it at 0.92x-1.12x of
  reduce-scatter end to end, within the shared machine's noise, so the fewer bytes decide.

Every step starts with one small all-gather on the group's CPU-side group (`agree`): each rank states
its token count, request count, whether it could replay a CUDA graph and at which batch size (and, with
adaptive k, its vote on the next k: engine/speculative/adaptive.py). All
ranks derive the same GroupPlan from the same table, so they pad to the same P, decide graph replay
together (a rank that cannot replay makes everyone run eagerly) and know whether anybody runs a forward
at all. A rank with no tokens in a step where others have some runs an idle forward: the MLP shards
over the other ranks' rows (its own contribute zero rows), so every collective is matched. Nothing here
depends on what a controller outside the engine believes the ranks hold.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.distributed.parallel import TPContext
from engine.scoped import ForwardScoped
from engine.speculative.adaptive import Vote, group_vote

EXCHANGES = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class DPContext:
    rank: int
    size: int
    group: object | None  # the device-side group of the MLP collectives (NCCL on GPUs, gloo on CPUs)
    cpu_group: object | None = None  # the lockstep agreement's group (gloo); None: `group` (a CPU engine)
    exchange: str = "reduce_scatter"
    # ShmCollectives of the same ranks (CPU ranks of one host, engine/distributed/shm_collectives.py): the row exchanges
    # and the agreement that fit its slots go through shared memory instead of gloo (all ranks alike: they
    # see the same shapes)
    shm: object | None = None
    expert_parallel: bool = False  # the MoE layers' routed experts sharded whole (TPContext.expert_parallel)

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError("attention data parallelism needs a group of two or more ranks")
        if self.group is None:
            raise ValueError("attention data parallelism needs a torch.distributed process group")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} out of range for attention_dp {self.size}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"unknown ADP exchange {self.exchange!r}; use one of {EXCHANGES}")

    @property
    def mlp_tp(self) -> TPContext:
        """How the MLP weights are sharded: across the whole group."""
        return TPContext(self.rank, self.size, self.group, expert_parallel=self.expert_parallel)

    # ------------------------------------------------------------------ the MLP's row exchange
    def mlp(self, x: torch.Tensor, shard_fn) -> torch.Tensor:
        """x [T_r, H] this rank's rows -> [T_r, H] the full MLP of them. shard_fn: [N, H] -> [N, H] this
        rank's MLP shard without the cross-rank reduction (its bias counted once over the group)."""
        T, H = x.shape
        P = current_rows()
        assert T <= P, (T, P)
        padded = x if T == P else torch.cat([x, x.new_zeros(P - T, H)])
        gathered = x.new_empty(self.size * P, H)  # rank r's rows at [r * P, (r + 1) * P)
        # partial below has gathered's shape and dtype: one fits() decides all three collectives
        shm = self.shm if self.shm is not None and self.shm.fits(gathered) else None
        if shm is not None:
            shm.all_gather_rows(gathered, padded)
        else:
            _all_gather(gathered, padded.contiguous(), self.group)
        partial = shard_fn(gathered)
        if self.exchange != "reduce_scatter":
            if shm is not None:
                shm.all_reduce(partial)
            else:
                dist.all_reduce(partial, group=self.group)
            return partial[self.rank * P:self.rank * P + T]
        mine = partial.new_empty(P, H)
        if shm is not None:
            shm.reduce_scatter_rows(mine, partial)
        else:
            _reduce_scatter(mine, partial.contiguous(), self.group)
        return mine[:T]

    def gather_rows(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """x [n, C] this rank's rows (n <= rows, the group's agreed bound) -> [size * rows, C] every rank's, rank r's
        at [r * rows, r * rows + n) and zeros after them. For small per-step records every rank must see alike (a
        draft tree's verification outcomes: engine/speculative/tree_step.py), on the device group."""
        n, C = x.shape
        assert n <= rows, (n, rows)
        padded = x if n == rows else torch.cat([x, x.new_zeros(rows - n, C)])
        out = x.new_empty(self.size * rows, C)
        if self.shm is not None and self.shm.fits(out):
            self.shm.all_gather_rows(out, padded)
        else:
            _all_gather(out, padded.contiguous(), self.group)
        return out

    # ------------------------------------------------------------------ the lockstep agreement
    def agree(self, mine: "RankPlan") -> "GroupPlan":
        """One all-gather of every rank's RankPlan; the same GroupPlan on every rank."""
        row = torch.tensor([mine.as_row()], dtype=torch.int64)  # [1, 4] (+ K + 2 with adaptive k's vote)
        table = torch.empty(self.size, row.shape[1], dtype=torch.int64)
        if self.shm is not None:  # CPU ranks of one host (then cpu_group is the MLP's group too)
            self.shm.all_gather_rows(table, row)
        else:
            _all_gather(table, row, self.cpu_group or self.group)
        return GroupPlan.from_table(table.tolist())


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank would run this step."""

    num_tokens: int  # target rows of its eager batch (0: nothing to run)
    num_requests: int  # running requests (the group's load decides dynamic k)
    can_graph: bool  # its batch could replay a captured graph
    graph_batch: int  # the captured batch size it would pad to (0 when it cannot)
    vote: Vote | None = None  # adaptive k: its say in the next step's k (every rank has one, or none has)

    def as_row(self) -> list[int]:
        row = [self.num_tokens, self.num_requests, int(self.can_graph), self.graph_batch]
        if self.vote is not None:
            row += [*self.vote.gain, *self.vote.cost, self.vote.requests]
        return row


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The group's decision for one step, derived identically on every rank."""

    tokens: tuple[int, ...]  # each rank's eager row count
    requests: tuple[int, ...]
    graph: bool  # every rank replays a graph of `graph_batch` (idle ranks an all-padding batch)
    graph_batch: int
    vote: Vote | None = None  # adaptive k: the group's (gains summed, the busy ranks' largest cost)

    @staticmethod
    def from_table(table: list[list[int]]) -> "GroupPlan":
        tokens = tuple(r[0] for r in table)
        busy = [r for r in table if r[0] > 0]
        # Replay only if every busy rank can (idle ranks replay an all-padding batch of any size): a rank
        # that must run eagerly would otherwise meet differently sized collectives.
        graph = bool(busy) and all(r[2] for r in busy)
        k = (len(table[0]) - 5) // 2  # a vote's row: gains [K], costs [K], requests
        vote = group_vote([Vote(tuple(r[4:4 + k]), tuple(r[4 + k:4 + 2 * k]), r[-1]) for r in table]) if k > 0 else None
        return GroupPlan(tokens=tokens, requests=tuple(r[1] for r in table), graph=graph,
                         graph_batch=max(r[3] for r in busy) if graph else 0, vote=vote)

    @property
    def forward(self) -> bool:
        """Some rank has rows to run: every rank takes part in the forward."""
        return any(self.tokens)

    @property
    def max_tokens(self) -> int:
        return max(self.tokens)

    @property
    def total_requests(self) -> int:
        return sum(self.requests)


# The groups here may be standalone ProcessGroup objects (cluster/groups.py builds them without a global
# world), which the functional `dist.*_into_tensor` wrappers do not accept in every torch release; the
# flat-buffer methods every ProcessGroup backend has (gloo, NCCL) take them directly. Both write rank r's
# part at [r * n, (r + 1) * n) of the flat dim 0.
def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    group._allgather_base(out, x).wait()


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group) -> None:
    group._reduce_scatter_base(out, x).wait()


# The row count P every rank pads its MLP rows to in the current forward (scoped like attention
# metadata: set around one forward, read by the MLPs; a captured graph bakes in its own).
_rows: ForwardScoped[int] = ForwardScoped(
    "adp_rows", "an ADP MLP runs only inside dp_rows(...): the group's padded row count")


def dp_rows(padded: int):
    return _rows.scope(padded)


def current_rows() -> int:
    return _rows.get()
