"""`tandem ray-start ARGS`: `ray start ARGS` with Ray's Prometheus exporters off (deploy/cluster.yaml starts
every node with it).

Ray 2.60 serves its metrics (node addresses and resource use, Serve's deployment names and request counts)
to any `GET`, with no token, on every interface of a node whose address is not loopback, from three exporters,
and `ray start` has no option for their address, a credential or turning them off (docs/reliability.md,
"Exposure"). Tandem needs none of them: its own metrics are the router's `/metrics`. So, while `ray start`
builds its processes' command lines (here, in this process):
- the dashboard agent (every node) gets `--disable-metrics-collection`, its own switch, which `ray start`
  never passes (`_private/services.py`, `start_raylet`): its exporter is then not created
  (`dashboard/modules/reporter/reporter_agent.py`);
- the autoscaler's monitor (head) loses `--monitor-ip`: without it the monitor starts no exporter
  (`autoscaler/_private/monitor.py`, `autoscaler/v2/monitor.py`: "If monitor_ip wasn't passed in, then don't
  attempt to start the metric server");
- the dashboard (head) has no switch: `DASHBOARD_METRIC_PORT` is set to -1, an out-of-range port, so its
  `prometheus_client.start_http_server` raises, which `dashboard/head.py` (`_setup_metrics`) catches, logs
  and goes on from.
A Ray whose command lines no longer look like this makes `tandem ray-start` fail, rather than start a node
with its exporters open (tests/deploy/test_two_node.py knocks on every port of a cluster started so).
"""
from __future__ import annotations

import os
import sys

AGENT_FLAG = "--dashboard_agent_command="  # the raylet's argument that carries the agent's command line
METRICS_OFF = "--disable-metrics-collection"
MONITOR_IP = "--monitor-ip="
DASHBOARD_METRIC_PORT_OFF = "-1"


class RayCommandChanged(RuntimeError):
    """This Ray builds its processes' command lines differently: the exporters cannot be switched off."""


def without_exporters(command: list[str], process_type: str) -> list[str]:
    """`command` (one Ray process's argv, as `ray start` would run it) with its Prometheus exporter off."""
    from ray._private import ray_constants

    if process_type == ray_constants.PROCESS_TYPE_RAYLET:
        agent = [i for i, word in enumerate(command) if word.startswith(AGENT_FLAG)]
        if len(agent) != 1:
            raise RayCommandChanged(f"the raylet's command has no single {AGENT_FLAG!r}: {command!r}")
        command = list(command)
        if METRICS_OFF not in command[agent[0]]:
            command[agent[0]] += f" {METRICS_OFF}"
        return command
    if process_type == ray_constants.PROCESS_TYPE_MONITOR:
        return [word for word in command if not word.startswith(MONITOR_IP)]
    return command


def main(argv: list[str]) -> int:
    from ray._private import services
    from ray.scripts.scripts import cli

    os.environ["DASHBOARD_METRIC_PORT"] = DASHBOARD_METRIC_PORT_OFF  # read when the dashboard process imports
    start_ray_process = services.start_ray_process

    def start_without_exporters(command, process_type, *args, **kwargs):
        return start_ray_process(without_exporters(command, process_type), process_type, *args, **kwargs)

    services.start_ray_process = start_without_exporters  # start_raylet and start_monitor look it up here
    # click's standalone mode: Ray's own usage errors and exit status (it ends the process, as `ray start` does)
    return cli.main(["start", *argv], prog_name="tandem ray-start", standalone_mode=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
