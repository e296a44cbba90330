"""What crosses the decode worker's boundaries besides its step link (cluster/protocol/step.py): the decode
target a prefill sends to and the replica's answer to opening a request. Small, frozen, picklable (they
cross Ray calls; a decode target holds actor handles)."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.rendezvous import StoreAddress


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """Where a prefill sends one rank's share of a hand-over."""
    actor: object  # ray.actor.ActorHandle of the DecodeRank
    store: StoreAddress  # the rank's rendezvous store (reached through Ray): channels to it meet there
    tp_rank: int
    kv_heads: tuple[int, int]  # (first KV head, count) of the full model's KV heads this rank holds


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The decode group's KV cache format; a hand-over must match it."""
    num_layers: int  # cache layers: the target's, then the draft's (speculation)
    num_kv_heads: int  # of the full model (each rank holds its slice)
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"


@dataclass(frozen=True, slots=True)
class DecodeTarget:
    """A decode group's address for one request: every rank gets its KV-head slice."""
    group_id: str  # changes whenever the group is rebuilt, so stale channels are never reused
    ranks: tuple[RankEndpoint, ...]
    layout: KVLayout
    device: str  # "cpu" or "cuda": the channel backend follows it
    # The ranks were told to pin the leading blocks of this request's prompt their prefix caches hold: before
    # packing, the prefill asks them how many (DecodeRank.pinned) and sends the blocks after them (engine
    # Handover.reusing); the hand-over header names the count.
    pinning: bool = False


@dataclass(frozen=True, slots=True)
class DecodeOpened:
    """A decode replica's answer to opening a request: where its hand-over goes, and which replica holds it
    (its deltas come on that replica's feed; a cancel must reach that replica)."""
    replica: str  # the Serve replica id
    target: DecodeTarget
    # The group prefills the request itself (its ranks held all but a short remainder of the prompt: the router
    # offered it with `local`): no prefill replica is asked, no hand-over comes, its first token comes on the
    # feed; `seed` is the seed it samples with (a resumption's).
    local: bool = False
    seed: int | None = None
