"""A prefill replica killed (SIGKILL) while prompts are in flight: the router resumes each request it held
(router/generation.py) on the restarted replica, with exactly the output an uninterrupted run gives (streamed and
whole), never an error or a hang; Serve restarts the replica, and no KV block stays in use anywhere. (A router
without resumption ends such requests with a typed error: tests/decode_worker/test_faults.py shows that path.)"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from bench.faults import LONG_PROMPT
from bench.load_client import kv_blocks_used
from cluster.testing import wait_for
from deploy.metrics_probe import scrape
from deploy.testing import start_router, stop_router
from tests.support.liveness import serves_completions
from tests.support.resume import completion, first_difference, same_output

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _resumptions(server, cause: str) -> float:
    return sum(v for (name, labels), v in scrape(httpx.get(f"{server.base_url}/metrics").text).items()
               if name == "tandem_request_resumptions_total" and ("cause", cause) in labels)


def test_killed_prefill_replica_resumes_its_requests_and_is_restarted(tandem_server):
    # A router that sends every prompt to the prefill replica: the second run of each prompt would otherwise be
    # prefilled by the decode group, which holds it (conditional disaggregation), and never reach the victim.
    router = start_router(tandem_server, "prefill-faults", local_prefill_max_tokens=0)
    try:
        _kill_prefill_under_requests(tandem_server, router)
    finally:
        stop_router("prefill-faults")


def _kill_prefill_under_requests(tandem_server, router):
    prefill = tandem_server.prefill_handle()
    killed = prefill.stats.remote().result()
    pid = killed["pid"]
    prompts = [(LONG_PROMPT + f" {i}", i % 2 == 0) for i in range(12)]
    kw = {"max_tokens": 48, "temperature": 0, "extra_body": {"ignore_eos": True}}
    resumed_before = _resumptions(router, "prefill")

    async def main():
        async with router.async_openai(timeout=300) as client:
            reference = await asyncio.gather(*[completion(client, tandem_server.model, p, s, **kw) for p, s in prompts])
            # Their own cache salt: the prefill replica computes the prompts again (from its cache they would be
            # done before the kill could land among them), the greedy tokens are the same.
            salted = {**kw, "extra_body": {**kw["extra_body"], "cache_salt": f"resumed-{os.getpid()}-{time.time()}"}}
            resumed = [asyncio.create_task(completion(client, tandem_server.model, p, s, **salted)) for p, s in prompts]
            await asyncio.to_thread(wait_for, lambda: prefill.stats.remote().result()["num_prompts"] > 0,
                                    "prompts running on the prefill replica", 60, 0.01)
            os.kill(pid, signal.SIGKILL)
            # a bound on a hang only: each request must end
            return reference, await asyncio.wait_for(asyncio.gather(*resumed), 240)

    reference, resumed = asyncio.run(main())
    for want, have, (prompt, stream) in zip(reference, resumed, prompts):
        assert want["outcome"] == "finished" and same_output(have, want), (stream, first_difference(have, want))
    assert _resumptions(router, "prefill") > resumed_before, "the kill came after every prompt had run"

    wait_for(lambda: serves_completions(router), "Serve restarts the prefill replica and requests succeed",
             300, 1.0)
    assert prefill.stats.remote().result()["pid"] != pid
    wait_for(lambda: not any(tandem_server.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)
    # /metrics follows the live replicas: the killed one's last figures are not reported beside its successor's
    wait_for(lambda: (lambda used: f"prefill/{killed['replica']}" not in used and any(
        k.startswith("prefill/") for k in used))(kv_blocks_used(httpx.get(f"{router.base_url}/metrics").text)),
        "the killed replica leaves /metrics", 60, 0.5)
