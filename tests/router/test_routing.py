"""The load-aware routing policy with several replicas: prompts spread over both prefill replicas and
requests over both decode groups, every worker's load reaches the router, and outputs stay correct."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster.testing import wait_for

pytestmark = pytest.mark.ray


def test_two_prefill_and_two_decode_replicas_share_the_load(tandem_server):
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from engine import LLM, SamplingParams

    cfg = TandemConfig(model=tandem_server.model_dir, served_model_name="multi", tp=1, prefill_replicas=2,
                       decode_replicas=2, num_kv_blocks=128, rank_num_cpus=0.5, prefill_num_cpus=0.5)
    serve.run(build_app(cfg), name="multi", route_prefix="/multi")
    try:
        prompts = [f"Hello {i}, how are you?" for i in range(16)]

        async def main():
            async with httpx.AsyncClient(base_url=f"{tandem_server.proxy_url}/multi", timeout=120) as http:
                rs = await asyncio.gather(*[http.post("/v1/completions", json={
                    "model": "multi", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
                    for p in prompts])
                return [r.json()["choices"][0]["text"] for r in rs]

        texts = asyncio.run(main())
        llm = LLM(tandem_server.model_dir, num_kv_blocks=128)
        want = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
        assert texts == want
        router = serve.get_deployment_handle("router", app_name="multi")
        def loads():  # routing stats arrive every STATS_PERIOD_S
            snap = router.routing_snapshot.remote().result()
            prefill_done = [s.get("handovers_total", 0) for s in snap["prefill"].values()]
            decode_steps = [s.get("steps", 0) for s in snap["decode"].values()]
            # Stats are periodic: a replica's snapshot may predate its first step, so wait for both to
            # have stepped (a group that never decodes fails here, naming what never happened).
            if len(prefill_done) == 2 and sum(prefill_done) == 16 and len(decode_steps) == 2 and min(decode_steps) > 0:
                return prefill_done, decode_steps

        prefill_done, decode_steps = wait_for(loads, "every replica's load reaches the router", poll_s=0.25)
        assert min(prefill_done) >= 2, prefill_done  # both prefill replicas took prompts
        assert min(decode_steps) > 0, decode_steps  # both decode groups decoded
    finally:
        serve.delete("multi")


def test_speculative_decode_group_gets_the_draft_kv_and_stays_lossless(tandem_server):
    """draft_model speculation (the draft shares the cache, so its KV layers ride in every hand-over)
    with a tp=2 decode group: greedy text equals the plain single-process engine's."""
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from engine import LLM, SamplingParams

    cfg = TandemConfig(model=tandem_server.model_dir, served_model_name="spec", tp=2, num_kv_blocks=128,
                       speculative_method="draft_model", draft=tandem_server.model_dir, num_speculative_tokens=3,
                       rank_num_cpus=0.5, prefill_num_cpus=0.5)
    serve.run(build_app(cfg), name="spec", route_prefix="/spec")
    try:
        prompts = ["Hello, how are you?", "The quick brown fox jumps over", "def add(a, b):"]
        with httpx.Client(base_url=f"{tandem_server.proxy_url}/spec", timeout=120) as http:
            texts = [http.post("/v1/completions", json={"model": "spec", "prompt": p, "max_tokens": 20,
                                                        "temperature": 0, "ignore_eos": True}).json()
                     for p in prompts]
        llm = LLM(tandem_server.model_dir, num_kv_blocks=128)
        want = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))]
        assert [t["choices"][0]["text"] for t in texts] == want
        decode = serve.get_deployment_handle("decode", app_name="spec")
        sent = decode.handover_timings.remote(3).result()
        m = llm.engine.model_cfg
        per_token_layer = 2 * 16 * m.num_kv_heads * m.head_dim * 4  # K and V of one block, fp32, all ranks
        for (_, _, nbytes), body in zip(sent, texts):
            blocks = -(-body["usage"]["prompt_tokens"] // 16)
            assert nbytes >= blocks * 2 * m.num_layers * per_token_layer  # target and draft layers
    finally:
        serve.delete("spec")


def test_mtp_hand_over_carries_the_drafts_and_stays_lossless(tandem_server, tmp_path):
    """The prefill drafts a request's first MTP drafts in the step that samples its first token; they travel in
    the header, and a sampled request's draft distributions (k x V fp32) with the KV to both ranks, whose first
    step verifies them. The tp=2 group's greedy text equals the plain engine's, and so does a seeded sampled
    request's (sampling keyed by seed and position)."""
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from engine import LLM, SamplingParams
    from tests.support.draft_heads import make_mtp_head  # a random MTP head in DeepSeek-V3 layout

    head = make_mtp_head(tmp_path / "mtp", tandem_server.model_dir, seed=1)
    cfg = TandemConfig(model=tandem_server.model_dir, served_model_name="mtp", tp=2, num_kv_blocks=128,
                       speculative_method="mtp", draft=str(head), num_speculative_tokens=2,
                       rank_num_cpus=0.5, prefill_num_cpus=0.5)
    serve.run(build_app(cfg), name="mtp", route_prefix="/mtp")
    try:
        prompts = ["Hello, how are you?", "def add(a, b):", "Once upon a time"]
        temps = [(0.0, None), (0.0, None), (0.8, 5)]
        with httpx.Client(base_url=f"{tandem_server.proxy_url}/mtp", timeout=120) as http:
            bodies = [http.post("/v1/completions", json={"model": "mtp", "prompt": p, "max_tokens": 16,
                                                         "temperature": t, "seed": seed, "ignore_eos": True}).json()
                      for p, (t, seed) in zip(prompts, temps)]
        llm = LLM(tandem_server.model_dir, num_kv_blocks=128)
        want = [llm.generate([p], SamplingParams(max_tokens=16, temperature=t, seed=seed, ignore_eos=True))[0].text
                for p, (t, seed) in zip(prompts, temps)]
        assert [b["choices"][0]["text"] for b in bodies] == want
        prefill = serve.get_deployment_handle("prefill", app_name="mtp")
        m = llm.engine.model_cfg
        for body, (t, _), (*_, nbytes, dropped) in zip(bodies, temps, prefill.handover_timings.remote(3).result()):
            blocks = -(-body["usage"]["prompt_tokens"] // 16)
            kv = blocks * (m.num_layers + 1) * 2 * 16 * m.num_kv_heads * m.head_dim * 4  # both ranks' heads, fp32
            probs = 2 * 2 * m.vocab_size * 4 if t else 0  # k x V fp32 to each of the two ranks; greedy: none
            assert not dropped and nbytes == kv + probs
    finally:
        serve.delete("mtp")
