"""The deployment path users take, on two real Ray nodes of this machine, one cluster for the module (starting
it and deploying is most of the cost): deploy/cluster.yaml's start commands (adapted by
deploy/local_cluster.py: ports, temp dirs; on this machine's network address where it has one, as a real
cluster's nodes listen), `serve deploy` of deploy/serve.yaml with an API key (model, device and sizes made
tiny; its placement resources kept), prefill on the `tandem_prefill` node and decode ranks on the
`tandem_decode` node, greedy tokens equal to the single-process engine's. The cluster is driven over HTTP and
the `serve` CLI only, beside the session's embedded Ray. In order:

1. Exposure (docs/reliability.md, "Exposure"): after a request has crossed (so hand-over channels and their
   gloo pairs exist), every listener of both nodes' process trees is knocked on as a stranger knocks, without
   Ray's token or the API key (tests/support/listeners.py):
   - every gRPC server (GCS, raylets, object managers, workers, agents, Serve replicas) refuses a call without
     the token, and a Ray driver without the token cannot join the cluster;
   - every HTTP server refuses a data path without credentials (the OpenAI port without the API key included):
     nothing answers, Ray's Prometheus exporters included (`tandem ray-start` starts the nodes with them off:
     deploy/ray_start.py), and nothing listens on their ports;
   - no TCPStore anywhere (the rendezvous goes through Ray: cluster/rendezvous.py): a TCPStore client finds none;
   - everything else (step and feed links, gloo pairs) answers nothing to a stranger's bytes;
   - the knocks change nothing served: the same greedy tokens afterwards.
2. The decode node is lost (its processes killed): requests get a typed error rather than a hang, and the
   deployment serves again once a node with the same resources joins.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass

import openai
import pytest
import yaml

from cluster.rendezvous import free_port_on
from cluster.testing import wait_for
from tests.support.cluster_serve import attempt, local_cluster, serve_config
from tests.support.listeners import Verdict, knock_all, listeners, routable_addresses

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HOST = (routable_addresses() or ["127.0.0.1"])[0]
PROMPTS = ["Hello, how are you?", "The quick brown fox", "def add(a, b):"]
# A TCPStore (Verdict.STORE) or an exporter (HTTP_ANSWERED) is none of these.
REFUSED = {Verdict.GRPC_REFUSED, Verdict.HTTP_REFUSED, Verdict.SILENT, Verdict.CLOSED}


@dataclass
class Deployed:
    cluster: object  # deploy.local_cluster.LocalCluster
    port: int
    api_key: str
    decode_node: str
    want: dict[str, str]  # the single-process engine's greedy text per prompt

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{HOST}:{self.port}/v1", api_key=api_key or self.api_key,
                             max_retries=0, timeout=120)

    def greedy(self, prompt: str) -> str:
        reply = self.client().completions.create(model="tandem-target", prompt=prompt, max_tokens=12,
                                                 temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].text

    def health(self):
        import httpx

        return httpx.get(f"http://{HOST}:{self.port}/health", timeout=30)


@pytest.fixture(scope="module")
def deployed(tiny_model_dir, tmp_path_factory):
    from engine import LLM, SamplingParams

    with local_cluster(host=HOST) as cluster:
        cluster.start_head("prefill_gpu")
        wait_for(lambda: cluster.dashboard and attempt(cluster.alive_nodes), "the head node up", 180, 1.0)
        cluster.start_worker("decode1", "decode_gpu")
        nodes = wait_for(lambda: len(attempt(cluster.alive_nodes) or {}) == 2 and cluster.alive_nodes(),
                         "the decode node joins", 180, 1.0)
        decode_node = next(n for n, r in nodes.items() if "tandem_decode" in r)

        port, api_key = free_port_on(""), secrets.token_hex(16)
        config_path = tmp_path_factory.mktemp("two-node") / "serve.yaml"
        config_path.write_text(yaml.safe_dump(serve_config(tiny_model_dir, port, host=HOST, api_key=api_key)))
        cluster.serve("deploy", str(config_path))
        wait_for(lambda: (cluster.applications().get("tandem") or {}).get("status") == "RUNNING",
                 "the application RUNNING", 300, 2.0)
        llm = LLM(tiny_model_dir, num_kv_blocks=64)
        want = {p: llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].text
                for p in PROMPTS}
        yield Deployed(cluster, port, api_key, decode_node, want)


def _node_of(actors: list[dict], class_prefix: str) -> set[str]:
    return {a["node_id"] for a in actors if a["class_name"].startswith(class_prefix)}


def _stranger_driver_refused(gcs: str, home: str) -> str:
    """A Ray driver with no token (its own HOME: no ~/.ray/auth_token) joining the GCS: what it printed;
    it must have failed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": home}
    done = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); print('JOINED')"],
                          capture_output=True, text=True, env=env, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "JOINED" not in out, out[-3000:]
    return out


def test_no_door_of_a_two_node_cluster_answers_a_stranger(deployed, tmp_path):
    cluster = deployed.cluster
    actors = cluster.actors()
    assert _node_of(actors, "ServeReplica:tandem:prefill") == set(cluster.alive_nodes()) - {deployed.decode_node}
    assert _node_of(actors, "DecodeRank") == {deployed.decode_node}
    assert len([a for a in actors if a["class_name"] == "DecodeRank"]) == 2
    assert deployed.greedy(PROMPTS[0]) == deployed.want[PROMPTS[0]]

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
    assert {p: deployed.greedy(p) for p in PROMPTS} == deployed.want

    # The API key is asked at the front door; Ray's token at the GCS.
    with pytest.raises(openai.AuthenticationError):
        deployed.client(api_key="stranger").models.list()
    _stranger_driver_refused(f"{HOST}:{cluster.gcs}", str(tmp_path))


def test_the_decode_node_is_lost_and_a_new_one_takes_over(deployed):
    cluster, decode_node = deployed.cluster, deployed.decode_node
    cluster.nodes["decode1"].stop(grace_s=0)  # the machine is gone
    wait_for(lambda: decode_node not in cluster.alive_nodes(), "the GCS marks the decode node dead", 120, 1.0)
    # reported with no request sent: the idle decode replica finds its ranks gone
    down = wait_for(lambda: deployed.health().status_code == 503 and deployed.health().json(),
                    "/health reports 503", 120, 1.0)
    assert down["status"] == "unavailable" and "no decode group is up" in down["reason"]
    with pytest.raises(openai.APIStatusError) as failed:  # a typed error, not a hang
        deployed.client().completions.create(model="tandem-target", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert failed.value.status_code == 503 and failed.value.body["type"] == "unavailable_error", failed.value.body

    cluster.start_worker("decode2", "decode_gpu")
    wait_for(lambda: deployed.health().status_code == 200, "/health back to 200", 300, 2.0)
    assert {p: deployed.greedy(p) for p in PROMPTS} == deployed.want
    new_decode = {n for n, r in cluster.alive_nodes().items() if "tandem_decode" in r}
    assert _node_of(cluster.actors(), "DecodeRank") == new_decode and decode_node not in new_decode
