"""The router's limits over HTTP: the API key, the body size limit and the admission bound (429), on a
second router application (deploy.testing.start_router) with small limits and a key, which shares the
session server's prefill and decode deployments."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from deploy.testing import start_router, stop_router

pytestmark = pytest.mark.ray

KEY = "s3cret-key"
BODY_LIMIT = 64 * 1024
MAX_INFLIGHT = 2


@pytest.fixture(scope="module")
def limited(tandem_server):
    server = start_router(tandem_server, "limited", max_inflight=MAX_INFLIGHT, max_body_bytes=BODY_LIMIT,
                          api_key=KEY)
    yield server
    stop_router("limited")


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_the_right_key_works_and_a_wrong_or_missing_key_gets_401(limited):
    kw = dict(model=limited.model, prompt="Hello", max_tokens=4, temperature=0)
    good = openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(**kw).usage.completion_tokens == 4
    assert [m.id for m in good.models.list().data] == [limited.model]
    wrong = openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(**kw)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with httpx.Client(base_url=limited.base_url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}  # open: load balancers probe it
        assert _error(http.get("/metrics"), 401)["type"] == "authentication_error"
        assert http.get("/metrics", headers=_auth()).status_code == 200
        _error(http.post("/v1/chat/completions", json={"model": limited.model, "messages": []}), 401)


def test_a_huge_body_gets_413_and_health_keeps_answering(limited):
    """Regression: a 60 MB body was read, parsed and tokenized by the router replica, which stopped
    answering anything (even /health) for minutes."""
    huge = b'{"model": "tiny", "prompt": "' + b"x" * (60 * 2**20) + b'"}'

    async def chunks():
        for i in range(0, len(huge), 2**20):
            yield huge[i:i + 2**20]

    async def main():
        # the bound on /health is a hang detector: it answered in milliseconds when this was written
        async with httpx.AsyncClient(base_url=limited.base_url, timeout=60) as http:
            sized = asyncio.create_task(http.post("/v1/completions", content=huge, headers=_auth()))
            chunked = asyncio.create_task(http.post("/v1/completions", content=chunks(), headers=_auth()))
            healths = []
            while not (sized.done() and chunked.done()) or len(healths) < 3:
                healths.append((await http.get("/health", timeout=15)).status_code)
            return await sized, await chunked, healths

    sized, chunked, healths = asyncio.run(main())
    for resp in (sized, chunked):
        err = _error(resp, 413)
        assert err["code"] == "request_too_large" and str(BODY_LIMIT) in err["message"]
    assert set(healths) == {200}
    client = openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=limited.model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_past_the_admission_bound_requests_get_429_with_retry_after_and_admitted_ones_finish(limited, tandem_server):
    n = 4 * MAX_INFLIGHT
    body = {"model": limited.model, "prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    want = tandem_server.openai().completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                                      extra_body={"ignore_eos": True}).choices[0].text

    async def main():
        async with httpx.AsyncClient(base_url=limited.base_url, timeout=120, headers=_auth(),
                                     limits=httpx.Limits(max_connections=n)) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(n)])

    responses = asyncio.run(main())
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert 1 <= len(admitted) <= MAX_INFLIGHT and refused
    assert [r.json()["choices"][0]["text"] for r in admitted] == [want] * len(admitted)
    for r in refused:
        err = _error(r, 429)
        assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
    # the bound frees as requests finish
    client = openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=limited.model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
