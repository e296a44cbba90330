"""The decode ranks' hand-over stock (decode_worker/stock.py): a header takes its blocks from the stock
the moment it arrives, or, when the stock is short, waits for a lockstep reserve. With a stock too small
for a burst both paths run at once on a tp=2 group; outputs equal the single-process engine's and every
block (the stock's included) is accounted for afterwards."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from deploy.testing import wait_decode_settled

pytestmark = pytest.mark.ray


def _burst_matches_the_engine(server, name: str, prompts: list[str], max_tokens: int, **settings) -> dict:
    """Deploy application `name` with `settings`, send `prompts` at once (greedy), check the texts equal the
    single-process engine's and that every block comes back; returns the decode stats, then deletes it."""
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from engine import LLM, SamplingParams

    cfg = TandemConfig(model=server.model_dir, served_model_name=name, rank_num_cpus=0.5, prefill_num_cpus=0.5,
                       **settings)
    serve.run(build_app(cfg), name=name, route_prefix=f"/{name}")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=f"{server.proxy_url}/{name}", timeout=120) as http:
                rs = await asyncio.gather(*[http.post("/v1/completions", json={
                    "model": name, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
                    for p in prompts])
                assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
                return [r.json()["choices"][0]["text"] for r in rs]

        texts = asyncio.run(main())
        llm = LLM(server.model_dir, num_kv_blocks=256)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert texts == [o.text for o in llm.generate(prompts, params)]
        stats = wait_decode_settled(name, "every block is back (in the pool or the stock)")
        assert stats["handovers_total"] == len(prompts)
        return stats
    finally:
        serve.delete(name)


def test_small_stock_serves_a_burst_by_both_paths(tandem_server):
    # 64 blocks x 0.1 = 6 stock blocks per rank; prompts of 1-4 blocks (16 tokens each), 12 at once.
    prompts = [" ".join(["word"] * (2 + 3 * (i % 5))) + f" {i}" for i in range(12)]
    stats = _burst_matches_the_engine(tandem_server, "stock", prompts, 10, tp=2, num_kv_blocks=64, handover_stock=0.1)
    # The stock served some at once; the burst (one prefill step's hand-overs, up to 4 blocks each, on a
    # 6-block stock) outran it, so others took the lockstep path.
    assert 0 < stats["handovers_stocked"] < stats["handovers_total"], stats


def test_a_one_rank_group_commits_stocked_hand_overs_on_landing(tandem_server):
    """tp=1: the rank commits each stocked hand-over at the first step boundary after its payload lands
    instead of waiting for the replica's COMMIT; outputs still equal the engine's, blocks all come back."""
    prompts = [f"Item {i} of the list is" for i in range(8)]
    stats = _burst_matches_the_engine(tandem_server, "early", prompts, 12, tp=1, num_kv_blocks=128)
    # Most on landing; one whose landing the replica reads while it runs a single long-poll step (nothing
    # decoding yet) gets the replica's COMMIT in the very next step, as under tp > 1.
    assert 0 < stats["handovers_committed_on_landing"] <= stats["handovers_stocked"], stats
