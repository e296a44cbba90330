"""A client that goes away mid-request aborts it, and its KV blocks are freed on both sides (the
/metrics KV gauges drop to zero well before the request could have finished by itself)."""
from __future__ import annotations

import time

import httpx
import pytest

from deploy.metrics_probe import scrape, worker_value

pytestmark = pytest.mark.ray


def _used_blocks(http: httpx.Client) -> tuple[float, float, float]:
    s = scrape(http.get("/metrics").text)
    return (worker_value(s, "tandem_kv_blocks_used", "decode"), worker_value(s, "tandem_kv_blocks_used", "prefill"),
            worker_value(s, "tandem_worker_queue_length", "decode"))


def _wait_for_zero(http: httpx.Client, deadline_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        decode, prefill, _ = _used_blocks(http)
        if decode == 0 and prefill == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"KV blocks still used {deadline_s:.1f}s after the disconnect: {_used_blocks(http)}")


def test_stream_disconnect_aborts_the_request_and_frees_its_blocks(tandem_server):
    body = {"model": tandem_server.model, "prompt": "The quick brown fox", "max_tokens": 220, "temperature": 0,
            "ignore_eos": True, "stream": True}
    decode = tandem_server.decode_handle()
    steps_before = decode.stats.remote().result()["steps"]
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
        _wait_for_zero(http, deadline_s=3.0)
        # Decoding all 220 tokens takes >= 219 decode steps; an aborted request stops far earlier.
        assert decode.stats.remote().result()["steps"] - steps_before < 150
        again = http.post("/v1/completions", json=dict(body, stream=False, max_tokens=4)).json()
        assert again["usage"]["completion_tokens"] == 4


def test_non_streaming_client_timeout_aborts_the_request(tandem_server):
    body = {"model": tandem_server.model, "prompt": "Hello, how are you?", "max_tokens": 220, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=tandem_server.base_url, timeout=60) as http:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{tandem_server.base_url}/v1/completions", json=body, timeout=1.5)
        _wait_for_zero(http, deadline_s=3.0)


def test_openai_stream_close_frees_blocks(tandem_server):
    client = tandem_server.openai()
    stream = client.completions.create(model=tandem_server.model, prompt="def add(a, b):", max_tokens=220,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 8:
            break
    stream.close()
    with httpx.Client(base_url=tandem_server.base_url, timeout=60) as http:
        _wait_for_zero(http, deadline_s=3.0)
