"""Cache-aware routing through the served path (issue 34): with two prefill replicas, prompts that share a
long prefix go to the replica that computed it. Each replica's reported BlockFilter holds the prefixes it
computed, hashed as the router hashes them (the engine's model name and block size, from the report), and
every later prompt is a full prefix hit on the replica its prefix lives on: the replicas' own hit counters
count exactly (later prompts) x (prefix tokens), and /metrics counts the routing decisions as "prefix".
Then a burst: prompts with two new prefixes sent all at once (as n > 1 children are) land together, each
prefix computed once, before any report could say where it lives."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.protocol.block_filter import BlockFilter
from cluster.protocol.load import PrefillLoad
from cluster.testing import wait_for
from deploy.metrics_probe import scrape
from deploy.testing import start_app, stop_app
from cluster.protocol import PREFILL_VERSION
from router.prefix_affinity import prompt_hashes, prefill_prompt

pytestmark = pytest.mark.ray

BLOCK = 16  # the served block size (EngineSettings.block_size)
SHARED = 6 * BLOCK
ROUNDS = 3  # prompts per prefix; the first computes it
BURST_SHARED = 10 * BLOCK  # past the engine's MIN_WAIT_TOKENS: a prompt arriving while its prefix is computed waits


def test_prompts_go_to_the_prefill_replica_holding_their_prefix(tandem_server):
    # local_prefill_max_tokens 0: every prompt to a prefill replica (the decode group would take repeats itself)
    server = start_app(tandem_server, "affinity", tp=1, prefill_replicas=2, prefill_num_cpus=0.5,
                       rank_num_cpus=0.5, local_prefill_max_tokens=0)
    try:
        from ray import serve

        router = serve.get_deployment_handle("router", app_name="affinity")
        vocab = server.prefill_handle().model_info.remote().result().vocab_size
        rng = random.Random(34)
        prefixes = [[rng.randrange(3, vocab) for _ in range(SHARED)] for _ in range(2)]
        # A, B, B, A, A, B: taking turns would send every later prompt but the last to the wrong replica
        prompts = [prefixes[i] + [rng.randrange(3, vocab) for _ in range(5)] for i in (0, 1, 1, 0, 0, 1)]
        with server.openai(timeout=300) as client:
            for prompt in prompts:
                client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)

        def reports(sent: int):  # the replicas' reports after their last prefill (stats arrive every STATS_PERIOD_S)
            def ready():
                loads = [PrefillLoad.from_wire(s) for s in router.routing_snapshot.remote().result()["prefill"].values()
                         if s]
                done = sum(dict(ld.prefix_cache).get("query_tokens", 0) for ld in loads)
                return loads if len(loads) == 2 and done == sent else None
            return wait_for(ready, "both prefill replicas report every prompt", poll_s=0.25)

        loads = reports(sum(map(len, prompts)))
        hits = {ld.replica: dict(ld.prefix_cache)["hit_tokens"] for ld in loads}
        assert sorted(hits.values()) == [(ROUNDS - 1) * SHARED] * 2, hits  # each prefix reused where it lives
        for prefix in prefixes:  # ... and only there: the router finds it in that replica's filter alone
            holders = [ld.replica for ld in loads
                       if BlockFilter(ld.cached_blocks).leading_matches(
                           prompt_hashes(prefill_prompt("prefill", [(PREFILL_VERSION, "r", tuple(prefix + [1]), {}, None), None]),
                                         ld.block_size, ld.prefix_model)) == SHARED // BLOCK]
            assert len(holders) == 1, holders
        samples = scrape(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
        decided = {labels: v for (name, labels), v in samples.items() if name == "tandem_routing_decisions_total"}
        assert decided[(("model", server.model), ("outcome", "prefix"), ("role", "prefill"))] == 2 * (ROUNDS - 1)

        burst_prefixes = [[rng.randrange(3, vocab) for _ in range(BURST_SHARED)] for _ in range(2)]
        burst = [burst_prefixes[i] + [rng.randrange(3, vocab) for _ in range(4)] for i in (0, 0, 1, 1, 1, 0)]
        with server.openai(timeout=300) as client, ThreadPoolExecutor(len(burst)) as pool:
            list(pool.map(lambda p: client.completions.create(model=server.model, prompt=p, max_tokens=2,
                                                              temperature=0), burst))
        after = reports(sum(map(len, prompts + burst)))
        burst_hits = sum(dict(ld.prefix_cache)["hit_tokens"] for ld in after) - sum(hits.values())
        assert burst_hits == 2 * 2 * BURST_SHARED, burst_hits  # each new prefix computed once, on one replica
    finally:
        stop_app("affinity")
