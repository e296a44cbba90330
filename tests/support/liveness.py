"""Whether a served application answers again: what the fault tests wait for after a kill or a restart."""
from __future__ import annotations


def serves_completions(server) -> bool:
    """True when a 4-token greedy completion through the openai client comes back whole; any failure means
    "not yet" (the tests poll this with cluster.testing.wait_for)."""
    try:
        out = server.openai(timeout=60).completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                                           temperature=0)
    except Exception:  # noqa: BLE001 - any failure means "not yet"
        return False
    return out.usage.completion_tokens == 4
