"""A two-node cluster started as deploy/cluster.yaml starts one (deploy/local_cluster.py), on this machine's
network address where it has one, serving deploy/serve.yaml with an API key: every listener of both nodes'
process trees is knocked on as a stranger knocks, without Ray's token or the API key
(tests/support/listeners.py), after a request has crossed (so hand-over channels and their gloo pairs exist).

What must hold (docs/reliability.md, "Exposure"):
- every gRPC server (GCS, raylets, object managers, workers, agents, Serve replicas) refuses a call without
  the token, and a Ray driver without the token cannot join the cluster;
- every HTTP server refuses a data path without credentials (the OpenAI port without the API key included):
  nothing answers, Ray's Prometheus exporters included (`tandem ray-start` starts the nodes with them off:
  deploy/ray_start.py), and nothing listens on their ports;
- no TCPStore anywhere (the rendezvous goes through Ray: cluster/rendezvous.py): a TCPStore client finds none;
- everything else (step and feed links, gloo pairs) answers nothing to a stranger's bytes;
- the knocks change nothing served: the same greedy tokens afterwards.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys

import openai
import pytest
import yaml

from cluster.rendezvous import free_port_on
from cluster.testing import wait_for
from tests.support.cluster_serve import attempt, local_cluster, serve_config
from tests.support.listeners import Verdict, knock_all, listeners, routable_addresses

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HOST = (routable_addresses() or ["127.0.0.1"])[0]  # a real cluster's nodes listen on their network address
PROMPTS = ["Hello, how are you?", "def add(a, b):"]
# A TCPStore (Verdict.STORE) or an exporter (HTTP_ANSWERED) is none of these.
REFUSED = {Verdict.GRPC_REFUSED, Verdict.HTTP_REFUSED, Verdict.SILENT, Verdict.CLOSED}


def _greedy(client: openai.OpenAI, prompt: str) -> str:
    reply = client.completions.create(model="tandem-target", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].text


def _stranger_driver_refused(gcs: str, home: str) -> str:
    """A Ray driver with no token (its own HOME: no ~/.ray/auth_token) joining the GCS: what it printed;
    it must have failed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": home}
    done = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); print('JOINED')"],
                          capture_output=True, text=True, env=env, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "JOINED" not in out, out[-3000:]
    return out


def test_no_door_of_a_two_node_cluster_answers_a_stranger(tiny_model_dir, tmp_path):
    from engine import LLM, SamplingParams

    with local_cluster(host=HOST) as cluster:
        cluster.start_head("prefill_gpu")
        wait_for(lambda: cluster.dashboard and attempt(cluster.alive_nodes), "the head node up", 180, 1.0)
        cluster.start_worker("decode1", "decode_gpu")
        wait_for(lambda: len(attempt(cluster.alive_nodes) or {}) == 2, "the decode node joins", 180, 1.0)

        port, api_key = free_port_on(""), secrets.token_hex(16)
        config_path = tmp_path / "serve.yaml"
        config_path.write_text(yaml.safe_dump(serve_config(tiny_model_dir, port, host=HOST, api_key=api_key)))
        cluster.serve("deploy", str(config_path))
        wait_for(lambda: (cluster.applications().get("tandem") or {}).get("status") == "RUNNING",
                 "the application RUNNING", 300, 2.0)
        client = openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key=api_key, max_retries=0, timeout=120)
        llm = LLM(tiny_model_dir, num_kv_blocks=64)
        want = {p: llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].text
                for p in PROMPTS}
        assert _greedy(client, PROMPTS[0]) == want[PROMPTS[0]]

        found = listeners(*(node.proc.pid for node in cluster.nodes.values()))
        names = {entry.process for entry in found}
        assert {"gcs_server", "raylet", "ray::DecodeRank"} <= names, names  # both trees, the ranks included
        knocks = knock_all(found, HOST)
        report = "\n".join(f"{k.listener.process:>32} {k.listener.host}:{k.listener.port} {k.verdict.name} {k.detail}"
                           for k in sorted(knocks, key=lambda k: (k.verdict.name, k.listener.process)))
        print(report)

        # The agents' exporters would listen on the port each node was given (dashboard's and autoscaler's: any
        # HTTP server that answers without credentials fails the next check).
        agent_exporters = {ports.own["metrics-export-port"] for ports in cluster.ports.values()}
        assert not {entry.port for entry in found} & agent_exporters, f"a Ray metrics exporter listens:\n{report}"
        open_doors = [k for k in knocks if k.verdict not in REFUSED]
        assert not open_doors, f"doors that answered a stranger or could not be told:\n{report}"
        assert {p: _greedy(client, p) for p in PROMPTS} == want

        # The API key is asked at the front door; Ray's token at the GCS.
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="stranger", max_retries=0).models.list()
        _stranger_driver_refused(f"{HOST}:{cluster.gcs}", str(tmp_path))
