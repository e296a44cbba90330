"""Gloo groups prove their members: every pair must deliver the proof its member put in the store before the group
is used (cluster/groups.py, `prove_members`)."""
from __future__ import annotations

import secrets
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cluster.errors import ChannelError
from cluster.groups import PROOF_BYTES, PROOF_TAG, GlooBackend, build_group
from cluster.rendezvous import StoreServer
from cluster.testing import returns


def _in_thread(fn) -> dict:
    done: dict = {}

    def _run():
        try:
            done["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            done["error"] = e

    t = threading.Thread(target=_run, daemon=True)
    t.start()
    done["thread"] = t
    return done


def test_members_prove_themselves_and_the_group_works():
    server = StoreServer()
    other = _in_thread(lambda: build_group(server.store, "g/", 1, 2, GlooBackend(), 60.0))
    group = returns(lambda: build_group(server.store, "g/", 0, 2, GlooBackend(), 60.0), "rank 0's group")
    other["thread"].join(60)
    x, y = torch.tensor([1.0]), torch.tensor([2.0])
    works = [group.allreduce([x]), other["value"].allreduce([y])]
    for w in works:
        w.wait()
    assert x.item() == y.item() == 3.0


def test_a_pair_held_by_someone_else_fails_the_group():
    """Regression (issue 39): gloo's listener gives a pair to whoever first writes the sequence number it waits
    for, with no credential, so a stranger who reached the port while a group formed held the pair and wrote
    into it. Here the other end of rank 0's pair is a gloo peer that is not the member whose proof is in the store
    (it cannot read the store, as a stranger cannot)."""
    server = StoreServer()
    scoped = dist.PrefixStore("g/", server.store)
    scoped.set("proof/1", secrets.token_bytes(PROOF_BYTES))  # the real rank 1's, never sent over the pair

    def impostor():
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=60)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(scoped, 1, 2, opts)
        theirs = torch.empty(PROOF_BYTES, dtype=torch.uint8)
        guess = torch.frombuffer(bytearray(secrets.token_bytes(PROOF_BYTES)), dtype=torch.uint8)
        for work in (group.send([guess], 0, PROOF_TAG), group.recv([theirs], 0, PROOF_TAG)):
            work.wait()
        return group

    held = _in_thread(impostor)
    with pytest.raises(ChannelError, match="pair to rank 1 leads to someone else"):
        returns(lambda: GlooBackend().build(scoped, 0, 2, timedelta(seconds=60)), "rank 0's build")
    held["thread"].join(60)
