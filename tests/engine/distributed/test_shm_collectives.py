"""Shared-memory collectives (engine/distributed/shm_collectives.py) against plain torch over the same inputs, across
processes: every rank gets the same (bit-identical) result, also over many rounds in a row (the alternating
buffers), and setting up falls back to None on every rank when one rank cannot map the segment."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed import shm_collectives

from tests.support.ranks import free_port
pytestmark = pytest.mark.skipif(not shm_collectives.available(), reason="shared-memory collectives: x86 Linux")

SHAPES = [(3, 5), (1, 192), (16, 4, 8), (7,), (2, 3, 1)]  # odd count: both kinds meet every shape
DTYPES = [torch.float32, torch.bfloat16]
ROUNDS = 60


def _inputs(rank: int, shape, dtype, round_: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * round_ + 10 * rank + len(shape))
    return torch.randn(shape, generator=g).to(dtype)


def _run_ranks(target, world: int, messages: int) -> list:
    """`world` spawned processes running target(rank, world, port, queue); the first `messages` items they
    put on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=120) for _ in range(messages)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("tandem-tp-")}


def _store(rank: int, world: int, port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, rank == 0, use_libuv=False)


def _collectives_main(rank: int, world: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    store = _store(rank, world, port)  # rank 0's serves the others: kept while they may still read it
    shm = shm_collectives.connect(store, "t/", rank, world, slot_bytes=2**16, timeout_s=30)
    out = {}
    for r in range(ROUNDS):  # a collective after another, alternating the kinds: the buffers alternate too
        shape, dtype = SHAPES[r % len(SHAPES)], DTYPES[(r // len(SHAPES)) % len(DTYPES)]
        x = _inputs(rank, shape, dtype, r)
        if r % 2:
            out[r] = shm.all_reduce(x.clone())
        else:
            out[r] = shm.all_gather_last_dim(x)  # kept as returned: it must not be a view of a slot
    strided = _inputs(rank, (8, 6), torch.float32, 999).t()  # not contiguous: reduced in place all the same
    out["strided"] = shm.all_reduce(strided).clone()
    out["fits"] = (shm.fits(torch.empty(2**14)), shm.fits(torch.empty(2**14 + 1)))
    # Attention data parallelism's exchanges (engine/distributed/data_parallel.py): rows in, rows out.
    gathered = torch.empty(world * 4, 6)
    shm.all_gather_rows(gathered, _inputs(rank, (4, 6), torch.float32, 500))
    out["gather_rows"] = gathered
    out["reduce_scatter_rows"] = torch.empty(4, 6)
    shm.reduce_scatter_rows(out["reduce_scatter_rows"], _inputs(rank, (world * 4, 6), torch.float32, 501))
    table = torch.empty(world, 4, dtype=torch.int64)
    shm.all_gather_rows(table, torch.tensor([[rank, 10 + rank, 1, 2]]))
    out["agreement"] = table
    # Tensors travel as lists (exact for fp32 and bf16): a tensor put on a queue is passed as a shared file
    # descriptor, which dies with the process that put it.
    queue.put((rank, {k: (v.tolist(), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in out.items()}))


def test_collectives_match_torch_and_agree_bitwise_across_ranks():
    world = 3
    before = _segments()
    got = {rank: {k: torch.tensor(v[0], dtype=v[1]) if isinstance(v, tuple) and len(v) == 2
                  and isinstance(v[1], torch.dtype) else v for k, v in out.items()}
           for rank, out in _run_ranks(_collectives_main, world, world)}
    for r in range(ROUNDS):
        shape, dtype = SHAPES[r % len(SHAPES)], DTYPES[(r // len(SHAPES)) % len(DTYPES)]
        parts = [_inputs(k, shape, dtype, r) for k in range(world)]
        if r % 2:
            want = torch.stack(parts).sum(dim=0)
            torch.testing.assert_close(got[0][r], want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)
        else:
            want = torch.cat(parts, dim=-1)
            assert torch.equal(got[0][r], want)
        assert all(torch.equal(got[k][r], got[0][r]) for k in range(world)), r
    strided = [_inputs(k, (8, 6), torch.float32, 999).t() for k in range(world)]
    torch.testing.assert_close(got[0]["strided"], sum(strided))
    assert got[0]["fits"] == (True, False)  # 64 KiB slots: 16384 floats fit, one more does not
    rows = [_inputs(k, (4, 6), torch.float32, 500) for k in range(world)]
    to_scatter = [_inputs(k, (world * 4, 6), torch.float32, 501) for k in range(world)]
    for k in range(world):
        assert torch.equal(got[k]["gather_rows"], torch.cat(rows))
        torch.testing.assert_close(got[k]["reduce_scatter_rows"], sum(y[k * 4:(k + 1) * 4] for y in to_scatter))
        assert got[k]["agreement"].tolist() == [[r, 10 + r, 1, 2] for r in range(world)]
    # The segment is unlinked once every rank has it mapped: nothing is left behind in /dev/shm.
    assert _segments() <= before


def _refusing_main(rank: int, world: int, port: int, queue) -> None:
    if rank == 1:
        shm_collectives.available = lambda: False  # as a rank on another host or container would find
    store = _store(rank, world, port)
    shm = shm_collectives.connect(store, "t/", rank, world, slot_bytes=2**16, timeout_s=30)
    queue.put((rank, shm is None))
    if rank:
        store.add("done", 1)
    else:  # rank 0's store serves the others: it stays until they are through with it
        while store.add("done", 0) < world - 1:
            time.sleep(0.01)


def test_one_rank_that_cannot_map_the_segment_leaves_every_rank_on_gloo():
    assert dict(_run_ranks(_refusing_main, 2, 2)) == {0: True, 1: True}


def _absent_peer_main(rank: int, world: int, port: int, queue) -> None:
    store = _store(rank, world, port)
    shm = shm_collectives.connect(store, "t/", rank, world, slot_bytes=2**16, timeout_s=2)
    queue.put((rank, "connected"))
    if rank == 0:
        try:
            shm.all_reduce(torch.ones(4))  # rank 1 never comes: an error naming it, not a hang
        except shm_collectives.ShmCollectivesError as e:
            queue.put((rank, str(e)))


def test_a_rank_that_never_reaches_the_collective_is_named_in_an_error():
    messages = _run_ranks(_absent_peer_main, 2, 3)
    errors = [m for r, m in messages if m != "connected"]
    assert errors and "tp rank(s) [1] did not reach collective 1" in errors[0], messages
