"""Prefix caching through the served hand-over (issue 34 item 2): a prompt whose long prefix the decode group
holds already (an earlier request's) is opened with its tokens, the group's ranks PIN those blocks in
lockstep, and the prefill sends only the rest: its hand-over moves 1 block where the first moved 7, the
decode replica counts the 6 reused blocks (stats and /metrics), and its greedy output equals that of the same
prompt under another cache salt (which shares nothing, so all of it travels). Every block comes back."""
from __future__ import annotations

import random

import httpx
import pytest

from deploy.metrics_probe import scrape
from deploy.testing import wait_decode_settled

pytestmark = pytest.mark.ray

BLOCK = 16  # the served block size (EngineSettings.block_size)
SHARED = 6 * BLOCK


def test_a_prompt_sharing_a_prefix_moves_only_the_rest(tandem_server):
    server = tandem_server
    vocab = server.prefill_handle().model_info.remote().result().vocab_size
    rng = random.Random(342)
    shared = [rng.randrange(3, vocab) for _ in range(SHARED)]
    first, second = (shared + [rng.randrange(3, vocab) for _ in range(5)] for _ in range(2))
    before = wait_decode_settled(server.app)
    with server.openai(timeout=300) as client:
        def complete(prompt, **extra) -> str:
            return client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True, **extra}).choices[0].text

        complete(first)
        reused = complete(second)
        alone = complete(second, cache_salt="nothing-shared")
    after = wait_decode_settled(server.app)
    assert reused == alone
    full, partial, salted = after["handover_bytes"][-3:]
    blocks = -(-len(second) // BLOCK)  # 7: 6 shared, the last one (with the prompt's last token) always travels
    assert full == salted == blocks * partial, (full, partial, salted)
    counted = after["prefix_cache"]["handover_reused_blocks"]
    assert counted - before["prefix_cache"].get("handover_reused_blocks", 0) == SHARED // BLOCK
    samples = scrape(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    exported = [v for (name, labels), v in samples.items()
                if name == "tandem_handover_blocks_reused_total" and ("role", "decode") in labels]
    assert exported == [counted]
