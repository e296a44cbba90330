"""Async scheduling on a served tp=2 decode group (--async-scheduling true): every rank launches step N+1
before reading step N, outputs (greedy and seeded, streamed or not) equal the single-process engine's,
and every KV block is back afterwards."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from deploy.testing import wait_decode_settled

pytestmark = pytest.mark.ray


def test_async_scheduling_serves_the_engines_tokens(tandem_server):
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from engine import LLM, SamplingParams

    cfg = TandemConfig(model=tandem_server.model_dir, served_model_name="ahead", tp=2, num_kv_blocks=64,
                       async_scheduling=True, rank_num_cpus=0.5, prefill_num_cpus=0.5)
    serve.run(build_app(cfg), name="ahead", route_prefix="/ahead")
    try:
        prompts = [" ".join(["word"] * (2 + 3 * (i % 4))) + f" {i}" for i in range(8)]
        bodies = [{"model": "ahead", "prompt": p, "max_tokens": 12, "ignore_eos": True,
                   "temperature": 0 if i % 2 else 0.8, "seed": 100 + i} for i, p in enumerate(prompts)]

        async def main():
            async with httpx.AsyncClient(base_url=f"{tandem_server.proxy_url}/ahead", timeout=120) as http:
                rs = await asyncio.gather(*[http.post("/v1/completions", json=b) for b in bodies])
                assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
                return [r.json()["choices"][0]["text"] for r in rs]

        texts = asyncio.run(main())
        llm = LLM(tandem_server.model_dir, num_kv_blocks=256)
        want = [llm.generate([p], SamplingParams(max_tokens=12, temperature=b["temperature"], seed=b["seed"],
                                                 ignore_eos=True))[0].text for p, b in zip(prompts, bodies)]
        assert texts == want
        stats = wait_decode_settled("ahead", "every block is back")
        assert stats["overlapped_steps"] > 0
    finally:
        serve.delete("ahead")
