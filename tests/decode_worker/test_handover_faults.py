"""Faults inside a hand-over, made to happen at an exact moment by fault points (cluster/faults.py) armed in
a dedicated application: a decode rank killed between the header and the payload, a payload that stalls
past its deadline, and a prefill killed with a hand-over still queued after its first token went out.
Each time the router resumes the request (router/generation.py; a fault point fires for a request's first
attempt only): it ends with exactly the output an uninterrupted run gives, never an error or a hang, the others
finish, the deployment serves again, and no KV block stays in use."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from bench.load_client import send_request
from cluster.testing import wait_for
from deploy.testing import start_app, stop_app
from tests.support.liveness import serves_completions
from tests.support.resume import completion, first_difference, same_output

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TRANSFER_TIMEOUT_S = 4.0
STALL_S = 12.0  # past the decode rank's payload deadline (TRANSFER_TIMEOUT_S)
QUEUED_S = 30.0  # a hand-over held before its headers while the test kills the prefill


@pytest.fixture(scope="module")
def armed(tandem_server):
    server = start_app(tandem_server, "armed", transfer_timeout_s=TRANSFER_TIMEOUT_S,
                       fault_points=f"handover.recv_payload=kill@-r1-,handover.send_payload=stall:{STALL_S:g},"
                                    f"handover.send_header=stall:{QUEUED_S:g}")
    yield server
    stop_app("armed")


def spec(server, prompt: str, stream: bool, request_id: str | None = None, max_tokens: int = 64) -> dict:
    return {"kind": "good", "path": "/v1/completions", "stream": stream,
            "headers": {"X-Request-Id": request_id} if request_id else None,
            "body": {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": stream}}


async def with_others(server, marked: dict, others: int = 4) -> tuple[dict, dict, list[dict]]:
    """The marked request sent while `others` ordinary requests are in flight: (the uninterrupted run of the
    same request, under an id no fault point fires for; the marked one's output; the others' outcomes)."""
    body = dict(marked["body"])
    kw = {"max_tokens": body["max_tokens"], "temperature": 0, "extra_body": {"ignore_eos": True}}
    async with httpx.AsyncClient(base_url=server.base_url) as http, server.async_openai(timeout=180) as client:
        reference = await completion(client, server.model, body["prompt"], marked["stream"], **kw,
                                     extra_headers={"X-Request-Id": "reference-1"})
        plain = [asyncio.create_task(send_request(http, spec(server, f"The quick brown fox {i}", i % 2 == 0), 180))
                 for i in range(others)]
        await asyncio.sleep(0.5)
        fault = await completion(client, server.model, body["prompt"], marked["stream"], **kw,
                                 extra_headers=marked["headers"])
        return reference, fault, list(await asyncio.gather(*plain))


def _resumptions(server) -> float:
    from deploy.metrics_probe import scrape

    return sum(v for (name, _), v in scrape(httpx.get(f"{server.base_url}/metrics").text).items()
               if name == "tandem_request_resumptions_total")


def test_decode_rank_killed_between_header_and_payload(armed):
    decode = armed.decode_handle()
    before = decode.stats.remote().result()
    resumed = _resumptions(armed)
    marked = spec(armed, "Hello, how are you?", stream=False, request_id="fault-handover.recv_payload-1")
    reference, fault, others = asyncio.run(with_others(armed, marked))
    assert reference["outcome"] == "finished" and same_output(fault, reference), first_difference(fault, reference)
    assert _resumptions(armed) > resumed
    # The group died under the others too: resumed, they finish.
    assert [o["outcome"] for o in others] == ["completed"] * len(others), others

    wait_for(lambda: serves_completions(armed), "the decode group is rebuilt and serves again", 300, 1.0)
    after = decode.stats.remote().result()
    assert after["groups_started"] == before["groups_started"] + 1
    wait_for(lambda: not any(armed.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)


def test_payload_stalled_past_its_deadline_resumes_that_request_only(armed):
    decode = armed.decode_handle()
    wait_for(lambda: serves_completions(armed), "the armed app serves", 300, 1.0)
    before = decode.stats.remote().result()
    resumed = _resumptions(armed)
    marked = spec(armed, "Hello, how are you?", stream=True, request_id="fault-handover.send_payload-1")
    reference, fault, others = asyncio.run(with_others(armed, marked))
    assert reference["outcome"] == "finished" and same_output(fault, reference), first_difference(fault, reference)
    assert _resumptions(armed) == resumed + 1
    assert [o["outcome"] for o in others] == ["completed"] * len(others), others

    assert serves_completions(armed)
    assert decode.stats.remote().result()["groups_started"] == before["groups_started"]  # no rebuild needed
    wait_for(lambda: not any(armed.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)


def test_prefill_killed_with_the_hand_over_still_queued(armed):
    """Regression: once the router had the first token it stopped watching the prefill, and the decode side
    waited for a header that could no longer come: the stream ended only at the decode side's header
    deadline (handover_timeout_s, 60 s). Now the death is seen at once and the stream resumes on the
    restarted prefill replica, with the first token it already sent not sent again."""
    wait_for(lambda: serves_completions(armed), "the armed app serves", 300, 1.0)
    prefill = armed.prefill_handle()
    before = prefill.stats.remote().result()
    kw = {"max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def main():
        async with armed.async_openai(timeout=180) as client:
            reference = await completion(client, armed.model, "Hello, how are you?", True, **kw,
                                         extra_headers={"X-Request-Id": "reference-2"})
            since = (await asyncio.to_thread(lambda: prefill.stats.remote().result()))["handovers_total"]
            got = asyncio.create_task(completion(client, armed.model, "Hello, how are you?", True, **kw,
                                                 extra_headers={"X-Request-Id": "fault-handover.send_header-1"}))
            # the sender took the hand-over (its first token is out) and holds it before the headers
            await asyncio.to_thread(wait_for, lambda: prefill.stats.remote().result()["handovers_total"] > since,
                                    "the hand-over reaches the sender", 60, 0.05)
            os.kill(before["pid"], signal.SIGKILL)
            return reference, await asyncio.wait_for(got, 170)  # a bound on a hang only

    reference, got = asyncio.run(main())
    assert reference["outcome"] == "finished" and same_output(got, reference), first_difference(got, reference)

    wait_for(lambda: serves_completions(armed), "Serve restarts the prefill replica and requests succeed", 300, 1.0)
    wait_for(lambda: not any(armed.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)
