"""Qwen3-MoE (softmax top-k, no shared experts, GQA attention) through the served path: router -> prefill ->
hand-over -> the decode group as DeepSeek's layout deploys it, the topology table's decode-tp2-adp row (attention
data parallelism: one rank receives a request's whole KV heads) with expert parallelism (each rank holds 4 of the
8 routed experts; partial sums meet in the MoE layer's reduction). Greedy outputs equal the single-process
engine's, the hand-over moves exactly the request's KV to its one rank, every KV block is free afterwards.
One app, the smallest settings; the DeepSeek-V3 twin (MLA, MTP, both rows) is test_mla_serving.py."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from deploy.testing import wait_decode_settled
from tests.support.qwen3_moe import make_qwen3_moe_checkpoint
from tests.support.topologies import BY_NAME

pytestmark = pytest.mark.ray

PROMPTS = ["The quick brown fox", "def add(a, b):", "Grüße aus Köln", "Tandem serves"]
BLOCK = 16  # the served block size (TandemConfig's default)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3-moe-served")
    make_qwen3_moe_checkpoint(path, "norm_topk", seed=31)
    return str(path)


@pytest.fixture(scope="module")
def reference(qwen3_moe_dir):
    from engine import LLM, SamplingParams

    llm = LLM(qwen3_moe_dir, num_kv_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def moe_app(tandem_server, qwen3_moe_dir):
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig

    topology = BY_NAME["decode-tp2-adp"]
    app = "moe-qwen3-adp-ep"
    args = topology.serve_args("cpu", qwen3_moe_dir, None)
    args.update(served_model_name=app, block_size=BLOCK, expert_parallel=True, speculative_method="none",
                num_speculative_tokens=0, num_kv_blocks=64)
    serve.run(build_app(TandemConfig(**args)), name=app, route_prefix=f"/{app}")
    try:
        yield app, f"{tandem_server.proxy_url}/{app}"
    finally:
        serve.delete(app)


def test_served_qwen3_moe_with_dp_attention_and_ep_equals_the_engine(moe_app, reference, qwen3_moe_dir):
    from ray import serve

    from engine.config import ModelConfig

    app, base = moe_app

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            return await asyncio.gather(*[
                http.post("/v1/completions", json={"model": app, "prompt": p, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0, "ignore_eos": True}) for p in PROMPTS])

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert [r.json()["choices"][0]["text"] for r in responses] == reference

    stats = wait_decode_settled(app, "every decode rank's KV blocks are free")
    assert all(used == 0 for _, used, _, _ in stats["dp_ranks"]), stats["dp_ranks"]
    placed = [p for p, _, _, _ in stats["dp_ranks"]]
    assert sum(placed) == len(PROMPTS) and min(placed) >= 1, placed  # each request on one rank, both used
    prefill = serve.get_deployment_handle("prefill", app_name=app)
    assert prefill.stats.remote().result()["kv_blocks_used"] == 0

    # Each hand-over: the request's blocks x layers x K and V x every KV head (whole, to its one rank), fp32.
    m = ModelConfig.from_dir(qwen3_moe_dir)
    per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4
    want = sorted(-(-r.json()["usage"]["prompt_tokens"] // BLOCK) * BLOCK * per_token for r in responses)
    timings = prefill.handover_timings.remote(len(PROMPTS)).result()
    assert not any(dropped for *_, dropped in timings)
    assert sorted(t[3] for t in timings) == want  # concurrent hand-overs: compare as multisets
