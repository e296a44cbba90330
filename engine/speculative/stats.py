"""Acceptance counters of speculative decoding: per request (RequestMetrics, reported as SpecUsage) and
engine-wide (the histogram of tokens emitted per decoding step, and the steps run at each dynamic k).
Without speculation (k = 0) nothing is counted and `stats()` reports no "spec" section."""
from __future__ import annotations

from engine.config import SpecConfig
from engine.core.request import Request
from engine.outputs import SpecUsage


class SpecStats:
    def __init__(self, spec: SpecConfig | None):
        self.spec = spec
        k = spec.k if spec is not None else -1
        self.accepted_length_hist = [0] * (k + 2)  # index: accepted drafts + 1
        self.dynamic_k_steps = [0] * (k + 1)  # steps per chosen k

    def count(self, req: Request, num_drafts: int, accepted: int, forced: int = 0) -> None:
        """A decoding step of `req` verified `num_drafts` drafts (`forced` of them forced by its grammar) and
        accepted `accepted` of them."""
        if self.spec is None:
            return
        m = req.metrics
        m.num_draft_tokens += num_drafts
        m.num_accepted_tokens += accepted
        m.num_forced_tokens += forced
        m.accepted_lengths.append(accepted + 1)
        self.accepted_length_hist[accepted + 1] += 1

    def usage(self, req: Request) -> SpecUsage | None:
        """The request's counts so far; None without speculation or before its first decoding step."""
        m = req.metrics
        if self.spec is None or not m.accepted_lengths:
            return None
        return SpecUsage(self.spec.method, m.num_draft_tokens, m.num_accepted_tokens, m.num_forced_tokens,
                         len(m.accepted_lengths))

    def reset(self) -> None:
        """Start counting afresh (benchmarks: after a warm-up)."""
        self.accepted_length_hist = [0] * len(self.accepted_length_hist)
        self.dynamic_k_steps = [0] * len(self.dynamic_k_steps)

    def as_dict(self) -> dict:
        if self.spec is None:
            return {}
        hist = self.accepted_length_hist
        steps = sum(hist)
        return {"spec": {"method": self.spec.method, "k": self.spec.k, "accepted_length_hist": list(hist),
                         "dynamic_k_steps": list(self.dynamic_k_steps),
                         "mean_accepted_length": sum(i * n for i, n in enumerate(hist)) / steps if steps else None}}
