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
    # (first KV head, count) of the full model's KV heads this rank holds: its slice under TP, all of them under
    # attention data parallelism or when the layout's heads are replicated (MLA: (0, 1), the whole latent)
    kv_heads: tuple[int, int]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The decode group's KV cache format (engine/layers/kv_spec.py, for the whole model); a hand-over must match
    it. Per cache layer and token a block holds planes x num_kv_heads x head_dim elements: K and V heads for the
    Llama family (planes 2), or MLA's latent row (planes 1, one head of kv_lora_rank + qk_rope_head_dim)."""
    num_layers: int  # cache layers: the target's, then the draft's (speculation; DeepSeek-V3's MTP layer)
    planes: int  # 2: K and V; 1: one row per token (the MLA latent and its rope key)
    num_kv_heads: int  # of the full model (MLA: 1, the latent)
    head_dim: int  # elements per head and plane (MLA: kv_lora_rank + qk_rope_head_dim)
    # Every TP rank holds all the heads (MLA: TP cannot split its one latent head; each rank caches it whole)
    # instead of its slice of them.
    replicated: bool
    block_size: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"

    @staticmethod
    def of(engine) -> "KVLayout":
        """The layout of an engine's cache (engine.LLMEngine: its runner's kv_spec, on any TP rank)."""
        spec, kv = engine.runner.kv_spec, engine.kv_cache
        return KVLayout(num_layers=kv.shape[0], planes=spec.planes,
                        num_kv_heads=spec.heads if spec.replicated else engine.model_cfg.num_kv_heads,
                        head_dim=spec.head_dim, replicated=spec.replicated, block_size=engine.cfg.block_size,
                        dtype=str(kv.dtype).removeprefix("torch."))


@dataclass(frozen=True, slots=True)
class DecodeTarget:
    """A decode group's address for one request: every rank gets its `kv_heads` of the cache."""
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
