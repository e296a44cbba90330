"""Attention data parallelism through the served path: router -> prefill -> hand-over to ONE rank (whole
KV heads) -> a dp=2 decode group with an MTP head. Greedy and guided outputs equal the single-process
engine's; requests spread over both ranks and /metrics says so; every rank's blocks are free afterwards."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from cluster.testing import wait_for
from tests.support.topologies import BY_NAME

pytestmark = pytest.mark.ray

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


@pytest.fixture(scope="module")
def adp_app(tandem_server, tmp_path_factory):
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from tests.support.draft_heads import make_mtp_head

    head = make_mtp_head(tmp_path_factory.mktemp("adp") / "mtp", tandem_server.model_dir, seed=1)
    # The ADP row of the integration tests' topology table (its CPU twin), with a hand-over stock on top.
    args = BY_NAME["decode-tp2-adp"].serve_args("cpu", tandem_server.model_dir, str(head))
    cfg = TandemConfig(**{**args, "served_model_name": "adp", "handover_stock": 0.125, "local_prefill_max_tokens": 128})
    serve.run(build_app(cfg), name="adp", route_prefix="/adp")
    try:
        yield f"{tandem_server.proxy_url}/adp", str(head)
    finally:
        serve.delete("adp")


def _decode_stats():
    from ray import serve

    return serve.get_deployment_handle("decode", app_name="adp").stats.remote().result()


def test_adp_group_serves_greedy_and_guided_like_one_process(adp_app, tandem_server):
    from engine import LLM, SamplingParams, SpecConfig
    from structured.request import StructuredOutput

    base, head = adp_app
    prompts = [f"Request {i}: tell me something." for i in range(8)]

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            plain = [http.post("/v1/completions", json={"model": "adp", "prompt": p, "max_tokens": 14,
                                                        "temperature": 0, "ignore_eos": True}) for p in prompts]
            guided = http.post("/v1/completions", json={
                "model": "adp", "prompt": "A record:", "max_tokens": 60, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}})
            return await asyncio.gather(*plain, guided)

    *plain, guided = asyncio.run(main())
    assert all(r.status_code == 200 for r in plain + [guided]), [r.text for r in plain + [guided]]
    llm = LLM(tandem_server.model_dir, num_kv_blocks=256, speculative=SpecConfig(method="mtp", k=2, draft=head))
    want = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))]
    assert [r.json()["choices"][0]["text"] for r in plain] == want
    want_guided = llm.generate(["A record:"], SamplingParams(max_tokens=60, temperature=0.0,
                                                             structured_output=StructuredOutput(json_schema=SCHEMA)))[0]
    body = guided.json()["choices"][0]
    assert body["text"] == want_guided.text
    if body["finish_reason"] == "stop":
        jsonschema.validate(json.loads(body["text"]), SCHEMA)

    # Placement: both ranks got requests, each request went to one rank; all blocks come back.
    def settled():
        s = _decode_stats()
        ranks = s["dp_ranks"]
        if all(used == 0 for _, used, _, _ in ranks) and s["num_requests"] == 0:
            return s

    stats = wait_for(settled, "every decode rank's KV blocks are free", poll_s=0.2)
    placed = [p for p, _, _, _ in stats["dp_ranks"]]
    assert sum(placed) == len(prompts) + 1 and min(placed) >= 2, placed
    assert stats["grammar"].get("compiles", 0) == 0  # the decode ranks deserialize; prefill compiles
    # Each rank's hand-over stock (12.5% of its blocks) took these small prompts without a lockstep reserve.
    assert stats["handovers_stocked"] == stats["handovers_total"] == len(prompts) + 1, stats

    text = httpx.get(f"{base}/metrics", timeout=30).text
    for rank, n in enumerate(placed):
        assert _series(text, "tandem_decode_dp_rank_requests_total", rank) == n, text
        assert _series(text, "tandem_decode_dp_rank_kv_blocks_used", rank) == 0, text


def _series(text: str, name: str, rank: int) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'dp_rank="{rank}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_adp_hand_over_sends_whole_heads_to_one_rank(adp_app, tandem_server):
    """Each request's KV goes once, whole heads, to its rank: bytes = its blocks x all KV heads x (target +
    head layers), never a copy per rank (a greedy request's first drafts ride in the header)."""
    from ray import serve

    from engine.config import ModelConfig

    base, _ = adp_app
    with httpx.Client(base_url=base, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": "adp", "prompt": "Count the blocks of this prompt please",
                                               "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    m = ModelConfig.from_dir(tandem_server.model_dir)
    blocks = -(-r.json()["usage"]["prompt_tokens"] // 16)
    kv = blocks * (m.num_layers + 1) * 2 * 16 * m.num_kv_heads * m.head_dim * 4  # fp32, target + MTP layer
    prefill = serve.get_deployment_handle("prefill", app_name="adp")
    _, _, _, nbytes, dropped = prefill.handover_timings.remote(1).result()[-1]
    assert not dropped and nbytes == kv


def test_adp_places_a_shared_prefix_on_the_rank_that_holds_it(adp_app, tandem_server):
    """Issue 34: a prompt whose long prefix one rank cached goes to that rank where load alone would pick the
    other (equal loads: rank 0), and that rank prefills its short remainder itself (conditional
    disaggregation: no hand-over); one with a long remainder goes there too and its hand-over reuses those
    blocks (PIN). Greedy outputs equal the same prompts under another cache salt, which shares nothing."""
    import random
    import threading

    from deploy.testing import wait_decode_settled

    base, _ = adp_app
    vocab = tandem_server.prefill_handle().model_info.remote().result().vocab_size
    rng = random.Random(3404)
    shared = [rng.randrange(3, vocab) for _ in range(6 * 16)]
    first, second = (shared + [rng.randrange(3, vocab) for _ in range(5)] for _ in range(2))
    third = shared + [rng.randrange(3, vocab) for _ in range(140)]  # 141 uncached tokens: more than 128

    def complete(prompt, max_tokens=6, **extra) -> str:
        with httpx.Client(base_url=base, timeout=120) as http:
            r = http.post("/v1/completions", json={"model": "adp", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def placed() -> list[int]:
        return [p for p, *_ in _decode_stats()["dp_ranks"]]

    wait_decode_settled("adp")
    start = placed()
    # a long request holds rank 0 (equal loads: the lowest rank) while `first` is placed: it goes to rank 1
    busy = threading.Thread(target=complete, args=([rng.randrange(3, vocab) for _ in range(40)], 64))
    busy.start()
    wait_for(lambda: placed()[0] > start[0], "the long request placed on rank 0")
    complete(first)
    busy.join()
    mid = [p for p, *_ in wait_decode_settled("adp")["dp_ranks"]]
    assert mid == [start[0] + 1, start[1] + 1], (start, mid)
    before = _decode_stats()
    text = complete(second)
    after = wait_decode_settled("adp")
    assert [p for p, *_ in after["dp_ranks"]] == [mid[0], mid[1] + 1]  # rank 1, which holds the prefix
    assert after["dp_placed_for_prefix"] == before["dp_placed_for_prefix"] + 1
    assert after["local_prefills"] - before["local_prefills"] == 1
    assert after["handovers_total"] == before["handovers_total"]
    assert complete(second, cache_salt="nothing-shared") == text
    before = wait_decode_settled("adp")
    text = complete(third)
    after = wait_decode_settled("adp")
    assert after["dp_ranks"][1][0] == before["dp_ranks"][1][0] + 1
    assert after["local_prefills"] == before["local_prefills"]
    assert after["handover_blocks_reused"] - before["handover_blocks_reused"] == 6
    assert complete(third, cache_salt="nothing-shared-either") == text


def test_adp_killed_rank_resumes_every_request_of_the_group_and_the_group_recovers(adp_app):
    """A dead rank takes the group's MLP shard with it: every in-flight request of the group fails there (the
    surviving rank's too, since its forward needs the dead shard), and the router resumes each of them
    (router/generation.py) on the rebuilt group, placed anew on its ranks, with exactly the output of an
    uninterrupted run (the app speculates with MTP: drafts are recomputed for each continuation)."""
    import os
    import signal

    import openai
    from ray import serve

    from tests.support.resume import completion, first_difference, same_output

    base, _ = adp_app
    decode = serve.get_deployment_handle("decode", app_name="adp")
    before = decode.stats.remote().result()
    pids = decode.rank_pids.remote().result()
    kw = {"max_tokens": 200, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300) as client:
            reference = await asyncio.gather(*[completion(client, "adp", f"Stream {i}", True, **kw) for i in range(4)])
            started = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(completion(client, "adp", f"Stream {i}", True, ev, **kw))
                     for i, ev in enumerate(started)]
            await asyncio.wait_for(asyncio.gather(*[ev.wait() for ev in started]), 120)
            os.kill(pids[1], signal.SIGKILL)
            return reference, await asyncio.wait_for(asyncio.gather(*tasks), 240)  # a bound on a hang only

    reference, got = asyncio.run(main())
    for i, (want, have) in enumerate(zip(reference, got)):
        assert want["outcome"] == "finished" and same_output(have, want), (i, first_difference(have, want))

    def served():
        r = httpx.post(f"{base}/v1/completions", json={"model": "adp", "prompt": "Hello", "max_tokens": 5,
                                                       "temperature": 0}, timeout=60)
        return r if r.status_code == 200 else None

    assert wait_for(served, "the ADP group recovers and serves again", timeout_s=300, poll_s=1.0)
    after = decode.stats.remote().result()
    assert after["groups_started"] == before["groups_started"] + 1
