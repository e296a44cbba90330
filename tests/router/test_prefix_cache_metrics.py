"""router/metrics.py: the prefix-cache series of each worker replica, exported as the worker's own running
totals (a router re-counting them would double them), and dropped with the replica."""
from __future__ import annotations

from deploy.metrics_probe import scrape
from router.metrics import RouterMetrics

COUNTS = {"query_tokens": 96, "hit_tokens": 64, "cached_blocks": 5, "evicted_blocks": 1}


def _series(text: str, name: str) -> dict[str, float]:
    return {f"{dict(labels)['role']}/{dict(labels)['replica']}": v
            for (n, labels), v in scrape(text).items() if n == name}


def test_each_replica_reports_its_counters_as_they_stand():
    m = RouterMetrics("tiny")
    m.prefix_cache("prefill", "p", COUNTS)
    m.prefix_cache("decode", "d", {**COUNTS, "hit_tokens": 0})
    m.prefix_cache("prefill", "p", {**COUNTS, "query_tokens": 200, "hit_tokens": 160})  # a later scrape
    text = m.render().decode()
    assert _series(text, "tandem_prefix_cache_queries_tokens_total") == {"prefill/p": 200.0, "decode/d": 96.0}
    assert _series(text, "tandem_prefix_cache_hits_tokens_total") == {"prefill/p": 160.0, "decode/d": 0.0}
    assert _series(text, "tandem_prefix_cache_cached_blocks") == {"prefill/p": 5.0, "decode/d": 5.0}
    assert _series(text, "tandem_prefix_cache_evicted_blocks_total") == {"prefill/p": 1.0, "decode/d": 1.0}


def test_a_replica_with_prefix_caching_off_has_no_series():
    m = RouterMetrics("tiny")
    m.prefix_cache("prefill", "p", COUNTS)
    m.prefix_cache("prefill", "p", {})  # turned off on a restart under the same replica id
    m.prefix_cache("decode", "d", {})
    assert "tandem_prefix_cache_queries_tokens_total{" not in m.render().decode()


def test_series_of_a_replica_that_is_gone_are_dropped():
    m = RouterMetrics("tiny")
    m.prefix_cache("prefill", "old", COUNTS)
    m.prefix_cache("prefill", "new", COUNTS)
    m.prefix_cache("decode", "d", COUNTS)
    m.forget_workers("prefill", {"new"})
    assert _series(m.render().decode(), "tandem_prefix_cache_hits_tokens_total") == {"prefill/new": 64.0,
                                                                                     "decode/d": 64.0}
    m.forget_workers("decode", set())
    assert _series(m.render().decode(), "tandem_prefix_cache_cached_blocks") == {"prefill/new": 5.0}
