"""Faults inside a hand-over, made to happen at an exact moment by fault points (cluster/faults.py) armed in
a dedicated application: a decode rank killed between the header and the payload, and a payload that
stalls past its deadline. Either way the request ends with a typed error instead of a hang, the others
finish or fail with a typed error, the deployment serves again, and no KV block stays in use."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.soak import _send
from cluster.testing import wait_for
from deploy.testing import start_app, stop_app
from tests.prefill_worker.test_faults import served

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TRANSFER_TIMEOUT_S = 4.0
STALL_S = 12.0  # past the decode rank's payload deadline (TRANSFER_TIMEOUT_S)


@pytest.fixture(scope="module")
def armed(tandem_server):
    server = start_app(tandem_server, "armed", transfer_timeout_s=TRANSFER_TIMEOUT_S,
                       fault_points=f"handover.recv_payload=kill@-r1-,handover.send_payload=stall:{STALL_S:g}")
    yield server
    stop_app("armed")


def spec(server, prompt: str, stream: bool, request_id: str | None = None, max_tokens: int = 64) -> dict:
    return {"kind": "good", "path": "/v1/completions", "stream": stream,
            "headers": {"X-Request-Id": request_id} if request_id else None,
            "body": {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": stream}}


async def with_others(server, marked: dict, others: int = 4) -> tuple[dict, list[dict]]:
    """The marked request sent while `others` ordinary requests are in flight; every outcome, each bounded."""
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        plain = [asyncio.create_task(_send(http, spec(server, f"The quick brown fox {i}", i % 2 == 0), 180))
                 for i in range(others)]
        await asyncio.sleep(0.5)
        fault = await _send(http, marked, 180)
        return fault, list(await asyncio.gather(*plain))


def test_decode_rank_killed_between_header_and_payload(armed):
    decode = armed.decode_handle()
    before = decode.stats.remote().result()
    marked = spec(armed, "Hello, how are you?", stream=False, request_id="fault-handover.recv_payload-1")
    fault, others = asyncio.run(with_others(armed, marked))
    assert fault["outcome"] == "typed_error" and fault["status"] == 503, fault
    assert "decode rank died" in fault["detail"]["message"] and "\n" not in fault["detail"]["message"], fault
    # The group died under the others too: they finished before, or failed with the same typed error.
    assert {o["outcome"] for o in others} <= {"completed", "typed_error"}, others

    wait_for(lambda: served(armed), "the decode group is rebuilt and serves again", 300, 1.0)
    after = decode.stats.remote().result()
    assert after["groups_started"] == before["groups_started"] + 1
    wait_for(lambda: not any(armed.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)


def test_payload_stalled_past_its_deadline_fails_that_request_only(armed):
    decode = armed.decode_handle()
    wait_for(lambda: served(armed), "the armed app serves", 300, 1.0)
    before = decode.stats.remote().result()
    marked = spec(armed, "Hello, how are you?", stream=True, request_id="fault-handover.send_payload-1")
    fault, others = asyncio.run(with_others(armed, marked))
    assert fault["outcome"] == "typed_error", fault
    assert "hand-over failed" in fault["detail"]["message"], fault
    assert [o["outcome"] for o in others] == ["completed"] * len(others), others

    assert served(armed)
    assert decode.stats.remote().result()["groups_started"] == before["groups_started"]  # no rebuild needed
    wait_for(lambda: not any(armed.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)
