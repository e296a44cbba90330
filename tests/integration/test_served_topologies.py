"""The whole served path per topology (tests/support/topologies.py), through the openai client: a Serve
app built from deploy/serve.yaml's args for the row, on CUDA where the machine has the GPUs the row needs,
and as its CPU twin everywhere.

Each row: greedy, seeded and guided outputs equal the single-process engine's on the same device type
(with an MTP head, so the speculative step runs behind the hand-over); the hand-over went over the
transport the row expects, read from /metrics (a silent fallback to gloo fails); and every prefill and
decode rank's KV blocks are free afterwards. Rows marked `kill_check` also lose a decode rank mid-stream.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import jsonschema
import openai
import pytest

from cluster.testing import wait_for
from deploy.testing import TandemServer
from tests.support.topologies import TOPOLOGIES, Topology

pytestmark = pytest.mark.ray

PROMPTS = ["Hello, how are you?", "The quick brown fox", "def add(a, b):", "Tandem serves models on Ray."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def _case(topology: Topology, device: str):
    marks = []
    if device == "cuda":
        marks.append(pytest.mark.gpu if topology.gpus == 1 else pytest.mark.multigpu)
    return pytest.param((topology, device), id=f"{topology.name}-{device}", marks=marks)


CASES = [_case(t, d) for t in TOPOLOGIES for d in ("cpu", "cuda")]


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Served:
    """A row's app (`server`: its URL, clients and deployment handles) and the reference engine."""

    def __init__(self, topology: Topology, device: str, server: TandemServer, args: dict):
        self.topology, self.device, self.server, self.args = topology, device, server, args
        self.model = server.model
        self._reference = None

    def client(self) -> openai.AsyncOpenAI:
        return self.server.async_openai(timeout=300)

    def reference(self):
        """The single-process engine on the same device, with the same MTP head and dtype."""
        if self._reference is None:
            from engine import LLM, SpecConfig

            self._reference = LLM(self.args["model"], device=self.device, dtype="float32", num_kv_blocks=256,
                                  speculative=SpecConfig(method="mtp", k=2, draft=self.args["draft"]))
        return self._reference

    def metrics(self) -> str:
        return httpx.get(f"{self.server.base_url}/metrics", timeout=60).text


@pytest.fixture(scope="module", params=CASES)
def served(request, tandem_server, tmp_path_factory):
    """One app per (row, device) at a time (module scope groups the tests by row), next to the session's."""
    from ray import serve

    from deploy.app import build_app
    from deploy.config import TandemConfig
    from tests.support.draft_heads import make_mtp_head

    topology, device = request.param
    if topology.not_built:
        pytest.skip(f"{topology.name}: {topology.not_built}")
    if device == "cuda" and cuda_devices() < topology.gpus:
        pytest.skip(f"{topology.name} needs {topology.gpus} CUDA device(s), {cuda_devices()} here")
    head = make_mtp_head(tmp_path_factory.mktemp(topology.name) / "mtp", tandem_server.model_dir, seed=1)
    args = topology.serve_args(device, tandem_server.model_dir, str(head))
    app = f"it-{topology.name}-{device}"
    cfg = TandemConfig(**args)
    serve.run(build_app(cfg), name=app, route_prefix=f"/{app}")
    try:
        yield Served(topology, device, TandemServer(f"{tandem_server.proxy_url}/{app}", tandem_server.model_dir,
                                                    cfg.name, cfg, app=app), args)
    finally:
        serve.delete(app)


def series(metrics: str, name: str, **labels) -> list[float]:
    """Values of `name` whose labels include `labels`."""
    out = []
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


def test_outputs_equal_the_single_process_engine(served):
    from engine import SamplingParams
    from structured.request import StructuredOutput

    async def main():
        async with served.client() as client:
            greedy = [client.completions.create(model=served.model, prompt=p, max_tokens=16, temperature=0,
                                                extra_body={"ignore_eos": True}) for p in PROMPTS]
            seeded = client.completions.create(model=served.model, prompt=PROMPTS[1], max_tokens=16, temperature=0.9,
                                               seed=1234, extra_body={"ignore_eos": True})
            guided = client.completions.create(
                model=served.model, prompt="A record:", max_tokens=60, temperature=0,
                extra_body={"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "r", "schema": SCHEMA}}})
            return await asyncio.gather(*greedy, seeded, guided)

    *greedy, seeded, guided = asyncio.run(main())
    llm = served.reference()
    want = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [r.choices[0].text for r in greedy] == [o.text for o in want]
    want_seeded = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=16, temperature=0.9, seed=1234,
                                                            ignore_eos=True))[0]
    assert seeded.choices[0].text == want_seeded.text
    want_guided = llm.generate(["A record:"], SamplingParams(max_tokens=60, temperature=0.0,
                                                             structured_output=StructuredOutput(json_schema=SCHEMA)))[0]
    assert guided.choices[0].text == want_guided.text
    if guided.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(guided.choices[0].text), SCHEMA)


def test_the_handover_used_the_expected_transport_and_every_block_is_free(served):
    async def main():
        async with served.client() as client:
            return await client.completions.create(model=served.model, prompt="Which transport?", max_tokens=4,
                                                   temperature=0, extra_body={"ignore_eos": True})

    asyncio.run(main())
    expected = served.topology.transport(served.device)

    def settled():
        text = served.metrics()
        used = (series(text, "tandem_kv_blocks_used", role="prefill") + series(text, "tandem_kv_blocks_used",
                                                                              role="decode")
                + series(text, "tandem_decode_dp_rank_kv_blocks_used"))
        if used and not any(used) and series(text, "tandem_handovers_by_transport", transport=expected):
            return text

    text = wait_for(settled, f"every rank's KV blocks are free and /metrics shows hand-overs over {expected}",
                    poll_s=0.5)
    by_transport = {t: sum(series(text, "tandem_handovers_by_transport", transport=t))
                    for t in ("gloo", "nccl", "ipc")}
    assert by_transport[expected] >= 1, by_transport
    assert sum(n for t, n in by_transport.items() if t != expected) == 0, by_transport
    n_ranks = served.topology.decode_tp
    assert len(series(text, "tandem_decode_dp_rank_kv_blocks_used")) == n_ranks, text


def test_a_killed_decode_rank_resumes_its_requests_and_the_group_returns(served):
    """The router resumes the dead group's streams (router/generation.py): each finishes with the single-process
    engine's text, as if nothing had happened."""
    if not served.topology.kill_check:
        pytest.skip(f"{served.topology.name}: the killed-rank check runs on the one-gpu row and in "
                    "tests/decode_worker/test_faults.py")
    from engine import SamplingParams

    decode = served.server.decode_handle()
    before = decode.stats.remote().result()["groups_started"]
    pids = decode.rank_pids.remote().result()

    async def stream(client, prompt, started):
        chunks, text = 0, ""
        try:
            s = await client.completions.create(model=served.model, prompt=prompt, max_tokens=400, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
            async for chunk in s:
                text += "".join(c.text for c in chunk.choices)
                chunks += 1
                if chunks == 2:
                    started.set()
        except openai.APIError as e:
            started.set()
            return "error", str(e)
        return "finished", text

    async def main():
        async with served.client() as client:
            started = [asyncio.Event() for _ in range(2)]
            tasks = [asyncio.create_task(stream(client, p, ev)) for p, ev in zip(PROMPTS, started)]
            await asyncio.gather(*[ev.wait() for ev in started])
            os.kill(pids[-1], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)

    results = asyncio.run(main())
    want = served.reference().generate(list(PROMPTS[:2]), SamplingParams(max_tokens=400, temperature=0.0,
                                                                         ignore_eos=True))
    assert [r for r in results] == [("finished", w.text) for w in want], results
    wait_for(lambda: decode.stats.remote().result()["groups_started"] > before, "the decode group is rebuilt",
             poll_s=0.5)

    async def again():
        async with served.client() as client:
            return await client.completions.create(model=served.model, prompt=PROMPTS[0], max_tokens=8,
                                                   temperature=0, extra_body={"ignore_eos": True})

    r = asyncio.run(again())
    want = served.reference().generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert r.choices[0].text == want[0].text
