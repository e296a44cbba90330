"""Decode replicas routed by the prompt blocks their groups hold (issue 34 item 3): with two decode replicas, each
reports its group's prefix view (DecodeLoad), and a prompt whose long prefix one group cached goes to that
replica where load alone would pick the other (equal loads: the lower replica id), whose rank pins the blocks so
the hand-over leaves them out; /metrics counts the decision as "prefix"."""
from __future__ import annotations

import random
import threading

import httpx
import pytest

from cluster.protocol.block_filter import BlockFilter
from cluster.protocol.load import DecodeLoad
from cluster.testing import wait_for
from deploy.metrics_probe import scrape
from deploy.testing import start_app, stop_app
from router.prefix_affinity import PromptKey, prompt_hashes

pytestmark = pytest.mark.ray

BLOCK = 16  # the served block size (EngineSettings.block_size)


def test_a_prompt_goes_to_the_decode_replica_holding_its_prefix(tandem_server):
    # local_prefill_max_tokens 0: the holder receives a hand-over of the rest (it would prefill it itself otherwise)
    server = start_app(tandem_server, "dec2", tp=1, decode_replicas=2, prefill_num_cpus=0.5, rank_num_cpus=0.5,
                       local_prefill_max_tokens=0)
    try:
        from ray import serve

        router = serve.get_deployment_handle("router", app_name="dec2")
        prefill = serve.get_deployment_handle("prefill", app_name="dec2")
        vocab = server.prefill_handle().model_info.remote().result().vocab_size
        rng = random.Random(3403)
        shared = [rng.randrange(3, vocab) for _ in range(6 * BLOCK)]
        first, second = (shared + [rng.randrange(3, vocab) for _ in range(5)] for _ in range(2))

        def complete(prompt, max_tokens=4, **extra) -> str:
            with server.openai(timeout=300) as client:
                return client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, extra_body={"ignore_eos": True, **extra}
                                                 ).choices[0].text

        def loads() -> dict[str, DecodeLoad]:
            snap = router.routing_snapshot.remote().result()["decode"]
            return {rid: DecodeLoad.from_wire(s) for rid, s in snap.items() if s}

        def holders(prompt) -> list[str]:
            out = []
            for rid, ld in loads().items():
                if not ld.block_size:  # nothing reported yet
                    continue
                hashes = prompt_hashes(PromptKey(tuple(prompt), None), ld.block_size, ld.prefix_model)
                if BlockFilter(ld.cached_blocks).leading_matches(hashes) == 6:
                    out.append(rid)
            return out

        complete([rng.randrange(3, vocab) for _ in range(8)])  # the router's decode handle exists from here on
        wait_for(lambda: len(loads()) == 2, "both decode replicas report")
        # a long request takes the lower replica id (equal loads), so `first` goes to the other
        streaming = threading.Event()

        def long_request():
            with server.openai(timeout=300) as client:
                for _ in client.completions.create(model=server.model, max_tokens=64, temperature=0, stream=True,
                                                   prompt=[rng.randrange(3, vocab) for _ in range(40)],
                                                   extra_body={"ignore_eos": True}):
                    streaming.set()  # decoding: its decode replica is chosen and busy

        busy = threading.Thread(target=long_request)
        busy.start()
        assert streaming.wait(120), "the long request streams"
        complete(first)
        busy.join()
        (holder,) = wait_for(lambda: holders(first) or None, "a decode replica reports the prefix it holds")
        wait_for(lambda: all(ld.num_requests == 0 and ld.kv_blocks_used == 0 for ld in loads().values()),
                 "both decode replicas idle")
        # Equal loads: load alone picks the lower replica id. The long request usually took it, so the prefix
        # lives on the other one and only the prefix can send `second` there; when the router's stats were too
        # old to see the long request, both sit on one replica and the prefix agrees with load ("load").
        outcome = "prefix" if holder != min(loads()) else "load"

        def decode_prefix_decisions() -> float:
            samples = scrape(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
            return sum(v for (name, labels), v in samples.items() if name == "tandem_routing_decisions_total"
                       and ("role", "decode") in labels and ("outcome", outcome) in labels)

        decided = decode_prefix_decisions()
        text = complete(second)
        assert decode_prefix_decisions() == decided + 1
        *_, nbytes, dropped = prefill.handover_timings.remote(1).result()[-1]
        alone = complete(second, cache_salt="nothing-shared")  # shares nothing: all 7 blocks travel
        *_, full, _ = prefill.handover_timings.remote(1).result()[-1]
        assert not dropped and full == 7 * nbytes, (full, nbytes)  # `second` moved 1 block: 6 were pinned
        assert text == alone
    finally:
        stop_app("dec2")
