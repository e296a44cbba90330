"""Paged KV cache writes: store_kv puts a step's new key/value rows into the per-layer caches at their slots
(`block_id * block_size + offset`; -1 = a padding row, skipped), as the Triton kernel on CUDA (or under
TRITON_INTERPRET=1) or the torch reference, with the same signature. The layout is kernels/attention.py's."""
from dataclasses import dataclass

import torch

from kernels import _attention_triton as _tr
from kernels._dispatch import next_pow2, use_triton
from kernels._launch import launch


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.dtype == v_cache.dtype and k_cache.device == v_cache.device
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "per-layer caches must be contiguous"


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Where store_kv_ref writes: index math that depends only on slot_mapping (one per step)."""

    src: torch.Tensor  # [T] row of key/value to write
    dst: torch.Tensor  # [T] flat slot
    keep: torch.Tensor  # [] bool: no real row at all, slot 0 rewrites its own contents
    # Host fact, read off a CPU slot_mapping (the reference path runs eagerly, never in a graph): every
    # row has a slot, so rows are written at slot_mapping itself (two ops per layer instead of eight).
    direct: bool = False


def plan_store_kv(slot_mapping: torch.Tensor) -> StorePlan:
    # Padding rows are redirected onto a real row of the batch (same slot, same value), so every
    # duplicate index writes identical data and index_copy_ stays deterministic without a host sync
    # (boolean indexing would make the shape data-dependent). With no real row at all, slot 0 is
    # rewritten with its own contents.
    valid = slot_mapping >= 0
    if slot_mapping.device.type == "cpu" and bool(valid.all()):
        return StorePlan(slot_mapping, slot_mapping, valid.new_zeros(()), True)
    first = valid.to(torch.int8).argmax()  # a real row if any exists
    any_valid = valid.any()
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    src = torch.where(valid, rows, first)
    dst = torch.where(valid, slot_mapping, torch.where(any_valid, slot_mapping[first], 0)).clamp_(min=0)
    return StorePlan(src, dst, ~any_valid)


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
    plan: StorePlan | None = None,  # plan_store_kv(slot_mapping), shared by the layers of a step
) -> None:
    check_cache(k_cache, v_cache)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
    v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
    if key.shape[0] == 0:
        return
    plan = plan if plan is not None else plan_store_kv(slot_mapping)
    if plan.direct:
        k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
        v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))
        return
    for flat, new in ((k_flat, key), (v_flat, value)):
        data = torch.where(plan.keep, flat[0].to(new.dtype), new.index_select(0, plan.src))
        flat.index_copy_(0, plan.dst, data.to(flat.dtype))


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    check_cache(k_cache, v_cache)
    T, H, D = key.shape
    assert value.shape == key.shape and k_cache.shape[2:] == (H, D), (key.shape, k_cache.shape)
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert slot_mapping.shape == (T,) and slot_mapping.dtype == torch.int64
    assert key.device == k_cache.device == slot_mapping.device
    if T == 0:
        return
    launch(
        _tr.store_kv_kernel, (T,), key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        H=H, D=D, BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D),
    )


def store_kv(key, value, k_cache, v_cache, slot_mapping, plan: StorePlan | None = None) -> None:
    """Write key/value `[T, Hkv, D]` into the paged caches at `slot_mapping` `[T]` (-1 = skip). In place.
    `plan` (reference path only) carries the index math of plan_store_kv, computed once per step."""
    if use_triton(key):
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping, plan)
