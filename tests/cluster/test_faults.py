"""cluster/faults.py: fault points are off unless armed, fire only for requests that name them (and only
where their `@` filter matches), and a malformed setting is refused with the reason."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cluster.faults import FaultAction, FaultPoints


def test_unarmed_points_do_nothing():
    faults = FaultPoints("")
    assert not faults
    faults.hit("handover.send_payload", "cmpl-fault-handover.send_payload")
    assert faults.fired == 0


def test_a_stall_fires_only_for_requests_that_name_the_point_and_where_its_filter_matches():
    faults = FaultPoints("handover.send_payload=stall:0.2@-r1-, handover.recv_payload=kill@never")
    assert faults.actions == {"handover.send_payload": FaultAction("stall", 0.2, "-r1-"),
                              "handover.recv_payload": FaultAction("kill", 0.0, "never")}
    faults.hit("handover.send_payload", "cmpl-plain", "chan-r1-x")  # not named by the request
    faults.hit("handover.send_payload", "cmpl-fault-handover.send_payload-1", "chan-r0-x")  # other rank
    assert faults.fired == 0
    start = time.monotonic()
    faults.hit("handover.send_payload", "cmpl-fault-handover.send_payload-1", "chan-r1-x")
    assert faults.fired == 1 and time.monotonic() - start >= 0.2
    faults.hit("handover.recv_payload", "cmpl-fault-handover.recv_payload", "chan-r1-x")  # filtered out
    assert faults.fired == 1


def test_kill_ends_the_process_with_sigkill():
    code = ("from cluster.faults import FaultPoints\n"
            "FaultPoints('handover.recv_payload=kill').hit('handover.recv_payload', 'x-handover.recv_payload')\n"
            "print('survived')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9 and "survived" not in out.stdout


@pytest.mark.parametrize("spec", ["nowhere=kill", "handover.send_payload", "handover.send_payload=stall",
                                  "handover.send_payload=stall:x", "handover.recv_payload=explode"])
def test_malformed_settings_are_refused(spec):
    with pytest.raises(ValueError, match="fault"):
        FaultPoints(spec)
