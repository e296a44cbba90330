"""A prefill replica killed (SIGKILL) while prompts are in flight: the requests it held end with a typed
error, not a hang, the rest finish, Serve restarts the replica, and no KV block stays in use anywhere."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from bench.faults import LONG_PROMPT
from bench.load_client import kv_blocks_used, send_request
from cluster.testing import wait_for
from tests.support.liveness import serves_completions

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_killed_prefill_replica_fails_its_requests_and_is_restarted(tandem_server):
    prefill = tandem_server.prefill_handle()
    killed = prefill.stats.remote().result()
    pid = killed["pid"]

    async def main():
        async with httpx.AsyncClient(base_url=tandem_server.base_url) as http:
            specs = [{"kind": "good", "path": "/v1/completions", "stream": i % 2 == 0,
                      "body": {"model": tandem_server.model, "prompt": LONG_PROMPT + f" {i}", "max_tokens": 48,
                               "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}} for i in range(16)]
            # a bound on a hang only: each request must end, with its tokens or an error
            sent = [asyncio.create_task(send_request(http, s, deadline_s=180)) for s in specs]
            await asyncio.to_thread(wait_for, lambda: prefill.stats.remote().result()["num_prompts"] > 0,
                                    "prompts running on the prefill replica", 60, 0.01)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*sent)

    outcomes = asyncio.run(main())
    errors = [o for o in outcomes if o["outcome"] != "completed"]
    assert not [o for o in outcomes if o["outcome"] not in ("completed", "typed_error")], outcomes
    assert errors, "the kill came after every prompt had run: nothing was in flight"
    assert {o["status"] for o in errors} <= {200, 503}, errors  # 200: a stream that failed after its first token
    for o in errors:  # one line a client can act on (Ray's account of the death, with pids and addresses, is logged)
        assert "prefill worker died" in o["detail"]["message"] and "\n" not in o["detail"]["message"], o

    wait_for(lambda: serves_completions(tandem_server), "Serve restarts the prefill replica and requests succeed",
             300, 1.0)
    assert prefill.stats.remote().result()["pid"] != pid
    wait_for(lambda: not any(tandem_server.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)
    # /metrics follows the live replicas: the killed one's last figures are not reported beside its successor's
    wait_for(lambda: (lambda used: f"prefill/{killed['replica']}" not in used and any(
        k.startswith("prefill/") for k in used))(kv_blocks_used(httpx.get(f"{tandem_server.base_url}/metrics").text)),
        "the killed replica leaves /metrics", 60, 0.5)
