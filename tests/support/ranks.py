"""Engine groups in spawned processes (tests/engine/distributed): a free TCP port for the gloo rendezvous, the ranks
run and their results collected (each rank's failure reported instead of waited on), and a group's engines stepped
together until none has work."""
from __future__ import annotations

import socket
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable, args: tuple, per_rank: int, world: int = 2, timeout_s: float = 600) -> dict:
    """Spawn `world` processes running target(rank, port, *args, queue); each puts `per_rank` results
    (rank, name, *rest), or (rank, "error", message, ...) when it fails. -> {(rank, name): rest}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world * per_rank):
            rank, name, *rest = queue.get(timeout=timeout_s)
            assert name != "error", f"rank {rank} failed: {rest[0]}"
            got[(rank, name)] = tuple(rest)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return got


def drive(engine, requests: list[tuple], group) -> dict:
    """requests: (request id, prompt, SamplingParams, the step to add it at) of this engine. Steps until no rank of
    the group (None: this engine alone) has work (every rank steps as long as one has: an ADP rank's idle forward
    matches the others'); -> request id -> (tokens, accepted lengths)."""
    done, step = {}, 0
    pending = list(requests)
    while True:
        for item in [x for x in pending if x[3] <= step]:
            engine.add_request(item[0], item[1], item[2])
            pending.remove(item)
        busy = torch.tensor([int(engine.has_unfinished() or bool(pending))])
        if group is not None:
            dist.all_reduce(busy, group=group)
        if not busy.item():
            return done
        for o in engine.step():
            if o.finished:
                done[o.request_id] = (o.token_ids, list(o.metrics.accepted_lengths))
        step += 1
