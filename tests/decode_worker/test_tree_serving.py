"""Draft trees (SpecConfig(topk > 1)) through the served path: router -> a prefill replica that drafts each
request's first tree in the step sampling its first token -> the tree's tokens and shape in the hand-over's
header -> a tp=2 decode group with attention data parallelism, each rank verifying and drafting its own requests'
trees. Greedy, guided and seeded sampled outputs equal the single-process engine without speculation (trees are
lossless), and each greedy request's speculative usage equals one process drafting the same trees (nodes ranked by
draft probability, SpecConfig.tree_score="draft": the learned ranking is learned per rank), the guided one's
grammar-forced nodes included (the first tree's cross in the header's drafts.forced); requests land on both ranks;
every rank's blocks come back."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from tests.support.topologies import BY_NAME

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
K, TOPK, NODES = 2, 2, 3  # depth 2, two children per expanded node, three nodes verified per request and step


def test_adp_group_serves_draft_trees_like_one_process(tandem_server, tmp_path):
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from deploy.testing import wait_decode_settled
    from engine import LLM, SamplingParams, SpecConfig
    from structured.request import StructuredOutput
    from tests.support.draft_heads import make_mtp_head  # a random MTP head in DeepSeek-V3 layout

    head = make_mtp_head(tmp_path / "mtp", tandem_server.model_dir, seed=1)
    args = BY_NAME["decode-tp2-adp"].serve_args("cpu", tandem_server.model_dir, str(head))
    cfg = TandemConfig(**{**args, "served_model_name": "tree", "num_speculative_tokens": K,
                          "speculative_topk": TOPK, "num_verify_tokens": NODES, "tree_score": "draft"})
    serve.run(build_app(cfg), name="tree", route_prefix="/tree")
    try:
        prompts = [f"Request {i}: tell me something." for i in range(4)]
        sampled = ("Once upon a time", 0.8, 5)

        async def main():
            async with httpx.AsyncClient(base_url=f"{tandem_server.proxy_url}/tree", timeout=120) as http:
                post = lambda body: http.post("/v1/completions", json={"model": "tree", **body})  # noqa: E731
                plain = [post({"prompt": p, "max_tokens": 14, "temperature": 0, "ignore_eos": True}) for p in prompts]
                seeded = post({"prompt": sampled[0], "max_tokens": 14, "temperature": sampled[1], "seed": sampled[2],
                               "ignore_eos": True})
                guided = post({"prompt": "A record:", "max_tokens": 60, "temperature": 0, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}})
                return await asyncio.gather(*plain, seeded, guided)

        *plain, seeded, guided = asyncio.run(main())
        assert all(r.status_code == 200 for r in plain + [seeded, guided]), [r.text for r in plain + [seeded, guided]]
        llm = LLM(tandem_server.model_dir, num_kv_blocks=256)
        want = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))]
        assert [r.json()["choices"][0]["text"] for r in plain] == want
        want_seeded = llm.generate([sampled[0]], SamplingParams(max_tokens=14, temperature=sampled[1], seed=sampled[2],
                                                                ignore_eos=True))[0].text
        assert seeded.json()["choices"][0]["text"] == want_seeded
        want_guided = llm.generate(["A record:"], SamplingParams(
            max_tokens=60, temperature=0.0, structured_output=StructuredOutput(json_schema=SCHEMA)))[0]
        body = guided.json()["choices"][0]
        assert body["text"] == want_guided.text
        if body["finish_reason"] == "stop":
            jsonschema.validate(json.loads(body["text"]), SCHEMA)
        # The same trees as one process drafts: the first the prefill drafted and handed over (dropped, the first
        # step would verify none), the rest each rank's own.
        trees = LLM(tandem_server.model_dir, num_kv_blocks=256, speculative=SpecConfig(
            method="mtp", k=K, draft=str(head), topk=TOPK, num_verify_tokens=NODES, tree_score="draft"))
        for r, o in zip(plain, trees.generate(prompts, SamplingParams(max_tokens=14, temperature=0.0,
                                                                      ignore_eos=True))):
            usage, one = r.json()["usage"]["speculative"], o.speculative
            assert (usage["draft_tokens"], usage["accepted_tokens"], usage["verify_steps"]) == (
                one.draft_tokens, one.accepted_tokens, one.verify_steps), (usage, one)
            assert one.draft_tokens > K * one.verify_steps  # wider than a chain of K would verify
        one = trees.generate(["A record:"], SamplingParams(
            max_tokens=60, temperature=0.0, structured_output=StructuredOutput(json_schema=SCHEMA)))[0].speculative
        usage = guided.json()["usage"]["speculative"]
        assert (usage["draft_tokens"], usage["accepted_tokens"], usage["forced_tokens"], usage["verify_steps"]) == (
            one.draft_tokens, one.accepted_tokens, one.forced_tokens, one.verify_steps), (usage, one)

        stats = wait_decode_settled("tree")  # every rank's KV blocks are free
        placed = [p for p, *_ in stats["dp_ranks"]]
        assert sum(placed) == len(prompts) + 2 and min(placed) >= 1, placed
    finally:
        serve.delete("tree")
