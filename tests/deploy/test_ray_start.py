"""`tandem ray-start`'s edits of Ray's command lines (deploy/ray_start.py); that a node started so has no
exporter listening is tests/deploy/test_two_node.py's check."""
from __future__ import annotations

import subprocess

import pytest
from ray._private import ray_constants

from deploy.ray_start import METRICS_OFF, RayCommandChanged, without_exporters

AGENT = ["python", "dashboard/agent.py", "--node-ip-address=10.0.0.2", "--metrics-export-port=8080"]


def _raylet(*extra: str) -> list[str]:
    return ["raylet", "--node_ip_address=10.0.0.2", *extra, "--num_prestart_python_workers=2"]


def test_the_agent_is_told_to_collect_no_metrics():
    command = _raylet(f"--dashboard_agent_command={subprocess.list2cmdline(AGENT)}")
    edited = without_exporters(command, ray_constants.PROCESS_TYPE_RAYLET)
    (agent,) = [word for word in edited if word.startswith("--dashboard_agent_command=")]
    assert agent.split("=", 1)[1].split() == [*AGENT, METRICS_OFF]
    assert [w for w in edited if not w.startswith("--dashboard_agent_command=")] == command[:2] + command[3:]
    assert without_exporters(edited, ray_constants.PROCESS_TYPE_RAYLET) == edited  # once only


def test_the_monitor_loses_its_metrics_address_and_nothing_else():
    command = ["python", "monitor.py", "--gcs-address=10.0.0.2:6379", "--monitor-ip=10.0.0.2"]
    assert without_exporters(command, ray_constants.PROCESS_TYPE_MONITOR) == command[:3]
    gcs = ["gcs_server", "--gcs_server_port=6379"]
    assert without_exporters(gcs, ray_constants.PROCESS_TYPE_GCS_SERVER) == gcs


def test_a_ray_that_builds_the_raylet_otherwise_is_refused():
    """Starting a node with its exporters open would be worse than not starting it."""
    with pytest.raises(RayCommandChanged, match="dashboard_agent_command"):
        without_exporters(_raylet(), ray_constants.PROCESS_TYPE_RAYLET)
