"""Reading the router's /metrics (Prometheus text) back into numbers: for tests and the benchmark."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of every sample."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def worker_value(samples: dict, name: str, role: str) -> float:
    """Sum of a per-worker gauge over the replicas of one role."""
    return sum(v for (n, labels), v in samples.items() if n == name and ("role", role) in labels)
