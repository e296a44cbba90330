"""The deployment path users take, on two real Ray nodes of this machine: deploy/cluster.yaml's start
commands (adapted by deploy/local_cluster.py: ports, loopback, temp dirs), `serve deploy` of
deploy/serve.yaml (model, device and sizes made tiny; its placement resources kept), prefill on the
`tandem_prefill` node and decode ranks on the `tandem_decode` node, greedy tokens equal to the
single-process engine's; then the decode node is lost (its processes killed), requests get a typed error
rather than a hang, and the deployment serves again once a node with the same resources joins.

The cluster is driven over HTTP and the `serve` CLI only, beside the session's embedded Ray."""
from __future__ import annotations

import openai
import pytest
import yaml

from cluster.rendezvous import free_port_on
from cluster.testing import wait_for
from tests.support.cluster_serve import attempt as _try
from tests.support.cluster_serve import local_cluster, serve_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = ["Hello, how are you?", "The quick brown fox", "def add(a, b):"]


@pytest.fixture
def cluster():
    with local_cluster() as local:
        yield local


def _node_of(actors: list[dict], class_prefix: str) -> set[str]:
    return {a["node_id"] for a in actors if a["class_name"].startswith(class_prefix)}


def _serving(app: dict | None) -> bool:
    return bool(app) and app["status"] == "RUNNING"


def test_two_nodes_serve_deploy_lose_the_decode_node_and_recover(cluster, tiny_model_dir, tmp_path):
    from engine import LLM, SamplingParams

    cluster.start_head("prefill_gpu")
    wait_for(lambda: cluster.dashboard and _try(cluster.alive_nodes), "the head node up", 180, 1.0)
    cluster.start_worker("decode1", "decode_gpu")
    nodes = wait_for(lambda: len(_try(cluster.alive_nodes) or {}) == 2 and cluster.alive_nodes(),
                     "the decode node joins", 180, 1.0)
    decode_node = next(n for n, r in nodes.items() if "tandem_decode" in r)

    port = free_port_on("127.0.0.1")
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(serve_config(tiny_model_dir, port)))
    cluster.serve("deploy", str(config_path))
    wait_for(lambda: _serving(cluster.applications().get("tandem")), "the application RUNNING", 300, 2.0)

    actors = cluster.actors()
    assert _node_of(actors, "ServeReplica:tandem:prefill") == {n for n in nodes if n != decode_node}
    assert _node_of(actors, "DecodeRank") == {decode_node}
    assert len([a for a in actors if a["class_name"] == "DecodeRank"]) == 2

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    llm = LLM(tiny_model_dir, num_kv_blocks=64)

    def greedy_matches() -> None:
        for prompt in PROMPTS:
            want = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
            got = client.completions.create(model="tandem-target", prompt=prompt, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == want.text

    greedy_matches()

    cluster.nodes["decode1"].stop(grace_s=0)  # the machine is gone
    wait_for(lambda: decode_node not in cluster.alive_nodes(), "the GCS marks the decode node dead", 120, 1.0)
    # reported with no request sent: the idle decode replica finds its ranks gone
    down = wait_for(lambda: _health(port).status_code == 503 and _health(port).json(), "/health reports 503",
                    120, 1.0)
    assert down["status"] == "unavailable" and "no decode group is up" in down["reason"]
    with pytest.raises(openai.APIStatusError) as failed:  # a typed error, not a hang
        client.completions.create(model="tandem-target", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert failed.value.status_code == 503 and failed.value.body["type"] == "unavailable_error", failed.value.body

    cluster.start_worker("decode2", "decode_gpu")
    wait_for(lambda: _health(port).status_code == 200, "/health back to 200", 300, 2.0)
    greedy_matches()
    new_decode = {n for n, r in cluster.alive_nodes().items() if "tandem_decode" in r}
    assert _node_of(cluster.actors(), "DecodeRank") == new_decode and decode_node not in new_decode


def _health(port: int):
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
