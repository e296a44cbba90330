"""A client that goes away mid-request aborts it, and its KV blocks are freed on both sides (the
/metrics KV gauges drop to zero, and the decode group ran far fewer steps than the request would have
needed to finish by itself)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster.testing import wait_for
from deploy.metrics_probe import scrape, worker_value

pytestmark = pytest.mark.ray


def _used_blocks(http: httpx.Client) -> tuple[float, float, float]:
    s = scrape(http.get("/metrics").text)
    return (worker_value(s, "tandem_kv_blocks_used", "decode"), worker_value(s, "tandem_kv_blocks_used", "prefill"),
            worker_value(s, "tandem_worker_queue_length", "decode"))


def _wait_for_zero(http: httpx.Client) -> None:
    wait_for(lambda: _used_blocks(http)[:2] == (0, 0), "KV blocks freed on both sides after the disconnect")


def _decode_steps(server) -> int:
    return server.decode_handle().stats.remote().result()["steps"]


def test_stream_disconnect_aborts_the_request_and_frees_its_blocks(tandem_server):
    body = {"model": tandem_server.model, "prompt": "The quick brown fox", "max_tokens": 220, "temperature": 0,
            "ignore_eos": True, "stream": True}
    steps_before = _decode_steps(tandem_server)
    with httpx.Client(base_url=tandem_server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            lines = resp.iter_lines()  # one iterator: dropping it would close the response early
            while events < 12:
                events += next(lines).startswith("data: {")
            decode_used, _, _ = _used_blocks(http)
            assert decode_used > 0  # the gauge sees the running request, so zero below means freed
            resp.close()  # the client goes away mid-stream
        _wait_for_zero(http)
        # Decoding all 220 tokens takes >= 219 decode steps; an aborted request stops far earlier.
        assert _decode_steps(tandem_server) - steps_before < 150
        again = http.post("/v1/completions", json=dict(body, stream=False, max_tokens=4)).json()
        assert again["usage"]["completion_tokens"] == 4


def test_non_streaming_client_gone_aborts_the_request(tandem_server):
    """The client leaves once the decode group runs its request (the event, not a client timeout that a
    fast server may beat); the request stops before its 220 tokens and its blocks are freed."""
    body = {"model": tandem_server.model, "prompt": "Hello, how are you?", "max_tokens": 220, "temperature": 0,
            "ignore_eos": True}
    decode = tandem_server.decode_handle()
    steps_before = _decode_steps(tandem_server)

    async def leave_once_decoding():
        async with httpx.AsyncClient(base_url=tandem_server.base_url, timeout=60) as client:
            post = asyncio.create_task(client.post("/v1/completions", json=body))
            while (await decode.stats.remote())["num_running"] == 0:
                assert not post.done(), "the request finished before the decode group was seen running it"
                await asyncio.sleep(0.01)
            post.cancel()  # the connection closes with the response still pending
            await asyncio.gather(post, return_exceptions=True)

    asyncio.run(leave_once_decoding())
    with httpx.Client(base_url=tandem_server.base_url, timeout=60) as http:
        _wait_for_zero(http)
    assert _decode_steps(tandem_server) - steps_before < 219  # aborted, not run to its 220th token


def test_openai_stream_close_frees_blocks(tandem_server):
    client = tandem_server.openai()
    stream = client.completions.create(model=tandem_server.model, prompt="def add(a, b):", max_tokens=220,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 8:
            break
    stream.close()
    with httpx.Client(base_url=tandem_server.base_url, timeout=60) as http:
        _wait_for_zero(http)
