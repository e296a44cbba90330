"""router/access.py's gate on a bare FastAPI app (no Ray): the API key and the body size limit, answered
in the OpenAI error shape before the body is read. The same gate in the served app: test_limits_http.py."""
from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from router.access import AccessGate, install_limits
from router.config import RouterSettings
from router.errors import install

LIMIT = 4096


@pytest.fixture
def make_client():
    def make(**settings) -> tuple[TestClient, list]:
        app = FastAPI()
        install(app)
        app.add_middleware(AccessGate)
        install_limits(app, RouterSettings(max_body_bytes=LIMIT, **settings))
        bodies_read: list[int] = []

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/v1/echo")
        async def echo(body: dict, request: Request):
            bodies_read.append(len(await request.body()))
            return {"keys": sorted(body)}

        return TestClient(app), bodies_read

    return make


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_a_body_over_the_limit_is_refused_from_content_length_before_reading(make_client):
    client, bodies_read = make_client()
    big = b'{"x": "' + b"a" * (2 * LIMIT) + b'"}'
    err = _error(client.post("/v1/echo", content=big, headers={"Content-Type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    assert bodies_read == []
    assert client.post("/v1/echo", json={"x": "a" * (LIMIT // 2)}).json() == {"keys": ["x"]}


def test_a_chunked_body_is_refused_once_it_passes_the_limit(make_client):
    client, bodies_read = make_client()
    def chunks():
        yield b'{"x": "'
        for _ in range(64):  # 64 KiB in all, 16 times the limit
            yield b"a" * 1024
        yield b'"}'

    err = _error(client.post("/v1/echo", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and bodies_read == []


def test_the_api_key_guards_every_route_but_health(make_client):
    client, _ = make_client(api_key="s3cret")
    assert client.get("/health").json() == {"status": "ok"}
    assert _error(client.post("/v1/echo", json={"a": 1}), 401)["type"] == "authentication_error"
    wrong = client.post("/v1/echo", json={"a": 1}, headers={"Authorization": "Bearer s3cre"})
    assert _error(wrong, 401)["code"] == "invalid_api_key"
    basic = client.post("/v1/echo", json={"a": 1}, headers={"Authorization": "Basic s3cret"})
    _error(basic, 401)
    ok = client.post("/v1/echo", json={"a": 1}, headers={"Authorization": "Bearer s3cret"})
    assert ok.json() == {"keys": ["a"]}


def test_the_key_is_checked_before_the_body_size(make_client):
    """An unauthenticated client learns nothing about the limits (401, not 413)."""
    client, _ = make_client(api_key="s3cret")
    _error(client.post("/v1/echo", content=b"x" * (2 * LIMIT)), 401)


def test_the_key_stays_out_of_the_settings_repr():
    assert "s3cret" not in repr(RouterSettings(api_key="s3cret"))
