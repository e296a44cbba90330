"""bench/soak.py, short: a seeded mix of 80 requests (bad ones, disconnects, tiny timeouts, guided) at
concurrency 8 against the session's server; nothing hangs, leaks KV blocks or goes unexplained."""
from __future__ import annotations

import asyncio
import os

import pytest

from bench.load_client import kv_blocks_used, tree_rss_mb
from bench.soak import bad_cases, soak

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_short_soak_leaves_nothing_behind(tandem_server):
    report = asyncio.run(soak(tandem_server.base_url, tandem_server.model, requests=80, concurrency=8, seed=1,
                              bad_share=0.2, server_pid=os.getpid()))
    assert report["hung"] == 0 and report["unexplained"] == 0, report
    assert report["bad_answered_wrong"] == 0, report["bad_wrong_examples"]
    assert report["kv_blocks_leaked"] == 0, report["kv_blocks_used_after"]
    assert report["health_after"] == 200 and report["passed"]
    assert report["outcomes"]["good"].get("completed", 0) > 0 and report["outcomes"]["bad"]


def test_the_soak_reads_blocks_from_metrics_and_rss_from_proc():
    text = ('tandem_kv_blocks_used{model="m",replica="abc",role="decode"} 3.0\n'
            'tandem_kv_blocks_used{model="m",replica="p1",role="prefill"} 0.0\n')
    assert kv_blocks_used(text) == {"decode/abc": 3.0, "prefill/p1": 0.0}
    assert tree_rss_mb(os.getpid()) > 1
    assert len(bad_cases()) >= 40
