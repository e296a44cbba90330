"""bench/faults.py, short: one fault (a decode rank killed mid-step) under a light load against the
session's server: it recovers, nothing hangs, no KV block stays in use; and the report's table."""
from __future__ import annotations

import asyncio
import os

import pytest

from bench.faults import markdown, run_faults


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_rank_under_load_is_survived_and_measured(tandem_server):
    [r] = asyncio.run(run_faults(tandem_server.base_url, tandem_server.model, os.getpid(), ["rank-step"],
                                 app=tandem_server.app, concurrency=4))
    assert r["injected"] and r["recover_s"] is not None, r
    assert r["hung"] == 0 and r["kv_blocks_leaked"] == 0, r
    assert r["outcomes"].get("completed", 0) > 0, r  # the load went on before and after the fault
    assert set(r["outcomes"]) <= {"completed", "typed_error"}, r
    # The session's router resumes what the killed rank held: nothing of the load is lost.
    assert r["errored"] == 0 and r["resumed"] >= 1, r


def test_the_table_says_what_was_skipped_and_what_each_fault_cost():
    table = markdown([{"what": "router replica killed", "skipped": True},
                      {"what": "decode rank killed mid-step", "skipped": False, "in_flight_at_fault": 4,
                       "recover_s": 12.5, "outcomes": {"completed": 30, "typed_error": 4}, "errored": 4,
                       "error_statuses": ["200", "503"], "hung": 0, "kv_blocks_used_after": {"decode/x": 0.0},
                       "resumed": 3.0, "pause_p50_s": 8.04, "pause_p99_s": 11.5}])
    assert "| router replica killed | | skipped (server not armed) | | | | |" in table
    assert ("| decode rank killed mid-step | 4 | 12.5 s | 30 / 4 (200, 503) / 0 | 3 | 8.0 / 11.5 s | "
            "{'decode/x': 0.0} |") in table
