"""Prefix caching through the served path (issue 34 item 2), both ways a prompt whose long prefix the decode
group holds already (an earlier request's) can go:
- conditional disaggregation (the session's application, RouterSettings.local_prefill_max_tokens on): the
  group holds all but a few of its tokens, so it prefills the rest itself: no prefill replica is asked, no
  hand-over moves, and the output equals that of the same prompt under another cache salt (which shares
  nothing, so it goes the whole disaggregated way), greedy and seeded, also for the next turn of a chat;
- a router that never offers it (local_prefill_max_tokens 0): the group's ranks PIN the held blocks in
  lockstep and the prefill sends only the rest: 1 block where the first moved 7.
Every block comes back."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import pytest

from deploy.metrics_probe import scrape
from deploy.testing import start_router, stop_router, wait_decode_settled

pytestmark = pytest.mark.ray

BLOCK = 16  # the served block size (EngineSettings.block_size)
SHARED = 6 * BLOCK


def _prompts(server, seed: int, count: int) -> list[list[int]]:
    vocab = server.prefill_handle().model_info.remote().result().vocab_size
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(SHARED)]
    return [shared + [rng.randrange(3, vocab) for _ in range(5)] for _ in range(count)]


def _complete(server, prompt, **extra):
    with server.openai(timeout=300) as client:
        choice = client.completions.create(model=server.model, prompt=prompt, max_tokens=8,
                                           temperature=extra.pop("temperature", 0),
                                           extra_body={"ignore_eos": True, **extra}).choices[0]
    return choice.text


def _prefill_handovers(server) -> int:
    return server.prefill_handle().stats.remote().result()["handovers_total"]


@pytest.fixture(scope="module")
def local(tandem_server):
    """The session's workers behind a router that offers prompts to the decode group (off by default)."""
    yield start_router(tandem_server, "local-prefill", local_prefill_max_tokens=128)
    stop_router("local-prefill")


def test_a_prompt_the_decode_group_nearly_holds_is_prefilled_there(tandem_server, local):
    server = local
    first, second, third = _prompts(server, 343, 3)
    before = wait_decode_settled(server.app)
    _complete(server, first)
    handed = _prefill_handovers(server)
    local_greedy = _complete(server, second)
    local_seeded = _complete(server, third, temperature=1.0, seed=11)
    assert _prefill_handovers(server) == handed  # neither went through a prefill replica
    mid = wait_decode_settled(server.app)
    assert mid["local_prefills"] - before["local_prefills"] == 2
    # 6 held blocks of 101 tokens: 5 computed by the group each
    assert mid["local_prefill_tokens"] - before["local_prefill_tokens"] == 2 * 5
    # The salted twins share nothing (each its own salt): they go the whole disaggregated way.
    assert local_greedy == _complete(server, second, cache_salt="nothing-shared-1")
    assert local_seeded == _complete(server, third, temperature=1.0, seed=11, cache_salt="nothing-shared-2")
    assert _prefill_handovers(server) == handed + 2
    # A longer prompt on the same prefix (as a chat's next turn is): local again, the same output as its twin.
    longer = second + [5, 6, 7]
    assert _complete(server, longer) == _complete(server, longer, cache_salt="nothing-shared-3")
    after = wait_decode_settled(server.app)
    assert after["local_prefills"] - mid["local_prefills"] == 1
    samples = scrape(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    exported = [v for (name, labels), v in samples.items()
                if name == "tandem_local_prefills_total" and ("role", "decode") in labels]
    assert exported == [after["local_prefills"]]


def test_a_prompt_sharing_a_prefix_moves_only_the_rest(tandem_server):
    server = tandem_server
    router = start_router(server, "no-local-prefill", local_prefill_max_tokens=0)
    try:
        first, second = _prompts(server, 342, 2)
        before = wait_decode_settled(server.app)
        _complete(router, first)
        reused = _complete(router, second)
        alone = _complete(router, second, cache_salt="nothing-shared")
        after = wait_decode_settled(server.app)
    finally:
        stop_router("no-local-prefill")
    assert reused == alone
    assert after["local_prefills"] == before["local_prefills"]
    full, partial, salted = after["handover_bytes"][-3:]
    blocks = -(-len(second) // BLOCK)  # 7: 6 shared, the last one (with the prompt's last token) always travels
    assert full == salted == blocks * partial, (full, partial, salted)
    counted = after["prefix_cache"]["handover_reused_blocks"]
    assert counted - before["prefix_cache"].get("handover_reused_blocks", 0) == SHARED // BLOCK
    samples = scrape(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    exported = [v for (name, labels), v in samples.items()
                if name == "tandem_handover_blocks_reused_total" and ("role", "decode") in labels]
    assert exported == [counted]


def test_a_locally_prefilled_request_ends_cleanly_at_its_first_token_or_when_its_client_leaves(tandem_server, local):
    """The first delta of a local request can be its last (max_tokens 1: the router closes it without a
    cancel), and a client that leaves mid-stream aborts it on the decode group; every block comes back."""
    server = local
    first, second, third = _prompts(server, 344, 3)
    _complete(server, first)
    before = wait_decode_settled(server.app)
    with server.openai(timeout=300) as client:
        one = client.completions.create(model=server.model, prompt=second, max_tokens=1, temperature=0)
        assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
        stream = client.completions.create(model=server.model, prompt=third, max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
    after = wait_decode_settled(server.app, "the abandoned local request's blocks are back")
    assert after["local_prefills"] - before["local_prefills"] == 2
    with server.openai(timeout=300) as client:
        twin = client.completions.create(model=server.model, prompt=second, max_tokens=1, temperature=0,
                                         extra_body={"cache_salt": "nothing-shared-4"})
    assert one.choices[0].text == twin.choices[0].text


def test_a_guided_request_goes_through_a_prefill_replica_even_when_the_group_holds_its_prompt(tandem_server, local):
    """A guided request is never offered to the decode group (router/generation.py local_eligible): its grammar
    compiles on the prefill replica, off the decode step, and comes over in the hand-over. Under a schema no
    rank has seen, whose prompt the group holds: a hand-over each, output held by the grammar from its first
    token, valid when complete."""
    server = local
    tag = random.Random().randrange(1 << 30)  # schemas this server has not compiled in any earlier test
    schemas = [{"type": "object", "properties": {f"k{tag}_{i}": {"type": "integer"}}, "required": [f"k{tag}_{i}"],
                "additionalProperties": False} for i in range(2)]
    messages = [{"role": "user", "content": " ".join(f"item{i}" for i in range(80))}]  # its blocks: the prefix
    with server.openai(timeout=300) as client:
        client.chat.completions.create(model=server.model, messages=messages, max_tokens=4, temperature=0)
        before = wait_decode_settled(server.app)
        handed = _prefill_handovers(server)
        outs = [client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=48, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": s}}) for s in schemas]
    after = wait_decode_settled(server.app)
    assert after["local_prefills"] == before["local_prefills"]
    assert _prefill_handovers(server) == handed + 2
    for out, schema in zip(outs, schemas):
        choice = out.choices[0]
        assert choice.finish_reason in ("stop", "length"), choice
        assert choice.message.content.startswith("{"), choice.message.content
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
