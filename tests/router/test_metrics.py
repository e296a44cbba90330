"""router/metrics.py: the per-worker series follow the live replicas."""
from __future__ import annotations

from bench.load_client import kv_blocks_used
from router.metrics import RouterMetrics


def test_series_of_a_replica_that_is_gone_are_dropped():
    """Regression: a killed replica's last KV figure stayed in /metrics for ever beside its successor's, so a
    replica that died holding blocks read as a leak (and the soak's leak check could never pass)."""
    m = RouterMetrics("tiny")
    m.worker("prefill", "old", used=5, total=64, queue=1)
    m.grammar("prefill", "old", {"compiles": 2})
    m.worker("prefill", "new", used=0, total=64, queue=0)
    m.worker("decode", "d", used=3, total=64, queue=0)
    m.dp_ranks("d", ((1, 3, 64, 1),))
    m.forget_workers("prefill", {"new"})
    text = m.render().decode()
    assert kv_blocks_used(text) == {"prefill/new": 0.0, "decode/d": 3.0}
    assert 'replica="old"' not in text
    m.forget_workers("decode", set())
    assert kv_blocks_used(m.render().decode()) == {"prefill/new": 0.0}
    assert 'replica="d"' not in m.render().decode()  # the routing counters keep their role="decode" rows
