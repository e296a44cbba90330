"""/metrics off the public port (`metrics_port`): the router replica serves it on its own port, loopback
by default, and the API port answers /metrics with a 404 in the OpenAI error shape."""
from __future__ import annotations

import httpx
import pytest

from cluster.rendezvous import free_port_on
from deploy.testing import start_router, stop_router

pytestmark = pytest.mark.ray


def test_metrics_served_on_their_own_port_only(tandem_server):
    port = free_port_on("127.0.0.1")
    router = start_router(tandem_server, "private-metrics", metrics_port=port)
    try:
        client = router.openai()
        client.completions.create(model=router.model, prompt="Hello", max_tokens=4, temperature=0)
        public = httpx.get(f"{router.base_url}/metrics", timeout=30)
        assert public.status_code == 404 and public.json()["error"]["code"] == "metrics_elsewhere"
        private = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert private.status_code == 200
        assert any(line.startswith("tandem_requests_total{") and 'endpoint="completions"' in line
                   and 'status="200"' in line for line in private.text.splitlines()), private.text
        assert "tandem_kv_blocks_used" in private.text
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 404
    finally:
        stop_router("private-metrics")
