"""The router replica killed (SIGKILL) with streams open: the clients' requests end (Serve's proxy closes
them or answers 5xx) instead of hanging, Serve restarts the router, requests succeed again, and the
decode replica ends the requests whose router died and frees their blocks (regression: it decoded them
to their last token for nobody, since Ray does not end a stream whose caller died)."""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from bench.faults import kill, replica_pids
from bench.load_client import send_request
from cluster.testing import wait_for
from tests.support.liveness import serves_completions

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 900  # far more decode steps than the clean-up after the kill may take


def test_killed_router_replica_ends_its_requests_and_is_restarted(tandem_server):
    pids = replica_pids("router", os.getpid(), tandem_server.app)  # this session's Ray runs below pytest
    assert len(pids) == 1, pids

    async def main():
        async with httpx.AsyncClient(base_url=tandem_server.base_url) as http:
            specs = [{"kind": "good", "path": "/v1/completions", "stream": i % 2 == 0,
                      "body": {"model": tandem_server.model, "prompt": "The quick brown fox", "max_tokens": MAX_TOKENS,
                               "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}} for i in range(6)]
            sent = [asyncio.create_task(send_request(http, s, deadline_s=120)) for s in specs]
            await asyncio.to_thread(wait_for, lambda: decode.stats.remote().result()["num_running"] >= 4,
                                    "requests decoding", 120, 0.05)
            at_kill.update(await asyncio.to_thread(lambda: decode.stats.remote().result()))
            kill(pids)
            return await asyncio.gather(*sent)

    decode = tandem_server.decode_handle()
    at_kill = {}
    outcomes = asyncio.run(main())
    assert not [o for o in outcomes if o["outcome"] == "hung"], outcomes
    assert [o for o in outcomes if o["outcome"] != "completed"], outcomes

    # The requests whose router died were ended, not decoded to their length for nobody: a step emits at most
    # k + 1 tokens of a request, so finishing them would take MAX_TOKENS / (k + 1) steps or more. Over a feed
    # link they end as it closes (11 steps after the kill here), not once Ray learns of the death (seconds:
    # 561 steps in one CI run before).
    ended = wait_for(lambda: (s := decode.stats.remote().result())["num_requests"] == 0 and s,
                     "the dead router's requests ended", 120, 0.05)
    most_per_step = tandem_server.config.num_speculative_tokens + 1
    assert ended["steps"] - at_kill["steps"] < MAX_TOKENS // most_per_step // 4, (ended["steps"], at_kill["steps"])

    wait_for(lambda: serves_completions(tandem_server), "Serve restarts the router and requests succeed", 300, 1.0)
    assert replica_pids("router", os.getpid(), tandem_server.app) not in ([], pids)
    wait_for(lambda: not any(tandem_server.kv_blocks_in_use().values()), "KV blocks in use back to 0", 180, 0.5)
    # Ray's word on the router's death still reaches the decode replica's count (its link closed first).
    wait_for(lambda: decode.stats.remote().result()["routers_lost"] > at_kill["routers_lost"], "the router counted lost",
             60, 0.5)
