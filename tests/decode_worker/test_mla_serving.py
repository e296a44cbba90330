"""DeepSeek-V3 (MLA + MoE, with its own MTP layer drafting k=2) through the served path: router -> prefill ->
hand-over of the latent cache -> a tp=2 decode group, as the topology table's two rows deploy it:
- decode-tp2: attention heads sharded, the latent replicated: every rank receives every request's whole latent
  (one plane of kv_lora_rank + qk_rope_head_dim per token and cache layer, the MTP layer's included);
- decode-tp2-adp: attention data parallelism, the layout MLA is made for: one rank receives a request's latent;
  with expert parallelism on top (each rank holds 4 of the 8 routed experts), DeepSeek's DP attention + EP MoE.
Greedy outputs equal the single-process engine's, a guided JSON request is valid against its schema, the
hand-over moves exactly the latent's bytes to the ranks it should, and every KV block is free afterwards."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from deploy.testing import wait_decode_settled
from tests.support.deepseek import add_mtp_layer, make_deepseek_checkpoint
from tests.support.topologies import BY_NAME

pytestmark = pytest.mark.ray

PROMPTS = ["The quick brown fox", "def add(a, b):", "Grüße aus Köln", "Tandem serves"]
# Closed (an enum, no free string): a random model still ends the object within the token budget.
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Ada", "Bob"]}, "n": {"type": "integer", "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
GUIDED_PROMPT = "A record:"
BLOCK = 16  # the served block size (TandemConfig's default)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("deepseek-served")
    add_mtp_layer(path, make_deepseek_checkpoint(path, "q_lora", seed=21), seed=22)
    return str(path)


@pytest.fixture(scope="module")
def reference(deepseek_dir):
    """The single-process engine's greedy and guided outputs, with the same MTP layer drafting."""
    from engine import LLM, SamplingParams, SpecConfig
    from structured.request import StructuredOutput

    llm = LLM(deepseek_dir, num_kv_blocks=128, speculative=SpecConfig(method="mtp", k=2))
    greedy = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    guided = llm.generate([GUIDED_PROMPT], SamplingParams(max_tokens=40, temperature=0.0,
                                                          structured_output=StructuredOutput(json_schema=SCHEMA)))[0]
    return greedy, guided.text


@pytest.fixture(scope="module", params=["decode-tp2", "decode-tp2-adp"])
def mla_app(request, tandem_server, deepseek_dir):
    """One app per row at a time, next to the session's (the speculation: the checkpoint's own MTP layer)."""
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig

    topology = BY_NAME[request.param]
    app = f"mla-{topology.name}"
    args = topology.serve_args("cpu", deepseek_dir, None)
    cfg = TandemConfig(**{**args, "served_model_name": app, "block_size": BLOCK,
                          "expert_parallel": topology.attention_dp > 1})
    serve.run(build_app(cfg), name=app, route_prefix=f"/{app}")
    try:
        yield topology, app, f"{tandem_server.proxy_url}/{app}"
    finally:
        serve.delete(app)


def test_served_deepseek_equals_the_engine_and_moves_only_the_latent(mla_app, reference, deepseek_dir):
    from ray import serve

    from engine.config import ModelConfig

    topology, app, base = mla_app
    want_greedy, want_guided = reference

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            greedy = [http.post("/v1/completions", json={"model": app, "prompt": p, "max_tokens": 12,
                                                         "temperature": 0, "ignore_eos": True}) for p in PROMPTS]
            guided = http.post("/v1/completions", json={
                "model": app, "prompt": GUIDED_PROMPT, "max_tokens": 40, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}})
            return await asyncio.gather(*greedy, guided)

    *greedy, guided = asyncio.run(main())
    assert all(r.status_code == 200 for r in greedy + [guided]), [r.text for r in greedy + [guided]]
    assert [r.json()["choices"][0]["text"] for r in greedy] == want_greedy
    for r in greedy:  # the MTP layer drafted behind the hand-over (its KV came with the latent, its first drafts too)
        spec = r.json()["usage"]["speculative"]
        assert spec["method"] == "mtp" and spec["draft_tokens"] > 0 and spec["verify_steps"] > 0, spec
    body = guided.json()["choices"][0]
    assert body["text"] == want_guided and body["finish_reason"] == "stop", body
    jsonschema.validate(json.loads(body["text"]), SCHEMA)

    stats = wait_decode_settled(app, "every decode rank's KV blocks are free")
    assert all(used == 0 for _, used, _, _ in stats["dp_ranks"]), stats["dp_ranks"]
    prefill = serve.get_deployment_handle("prefill", app_name=app)
    assert prefill.stats.remote().result()["kv_blocks_used"] == 0
    if topology.attention_dp > 1:  # each request on one rank, and both ranks used
        placed = [p for p, _, _, _ in stats["dp_ranks"]]
        assert sum(placed) == len(PROMPTS) + 1 and min(placed) >= 1, placed

    # The hand-over of each request: its blocks x (3 target layers + the MTP layer) x one latent row of
    # kv_lora_rank + qk_rope_head_dim fp32 elements (greedy: the first drafts ride in the header); once per rank
    # that holds it (tp=2: both ranks, whole; ADP: its one rank), never a head slice.
    m = ModelConfig.from_dir(deepseek_dir)
    receivers = 1 if topology.attention_dp > 1 else topology.decode_tp
    latent_row = (m.num_layers + 1) * m.mla.cache_width * 4  # per token, every cache layer, fp32

    def handover_bytes(response) -> int:
        blocks = -(-response.json()["usage"]["prompt_tokens"] // BLOCK)
        return receivers * blocks * BLOCK * latent_row

    timings = prefill.handover_timings.remote(len(PROMPTS) + 1).result()
    assert not any(dropped for *_, dropped in timings)
    # The hand-overs ran concurrently: compare as multisets.
    assert sorted(t[3] for t in timings) == sorted(handover_bytes(r) for r in greedy + [guided])
