"""Prefix caching through the served path (issue 34): requests that share a long prompt prefix, sent one
after another to the session's application (prefix caching on, the default), get the greedy tokens of an
application with it off; the prefill replica computes only each later prompt's uncached suffix (its stats and
/metrics count the reused tokens exactly), and afterwards every KV block is free on both sides. They go through a
router that never lets the decode group prefill a prompt itself (local_prefill_max_tokens 0): the decode group
holds those prefixes too, and would otherwise take the later prompts (tests/decode_worker/test_prefix_handover_served.py)."""
from __future__ import annotations

import random

import httpx
import pytest

from cluster.testing import wait_for
from deploy.metrics_probe import scrape, worker_value
from deploy.testing import start_app, start_router, stop_app, stop_router, wait_decode_settled

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BLOCK = 16  # the served block size (EngineSettings.block_size)
SHARED = 5 * BLOCK  # the shared prefix: five full blocks
SUFFIXES = (7, 3, 12, 9)  # each request's own tail; the first one computes the prefix
MAX_TOKENS = 12


def _prompts(vocab_size: int) -> list[list[int]]:
    """Token-id prompts, so that the shared prefix is exactly SHARED tokens (text could merge at the seam)."""
    rng = random.Random(34)
    prefix = [rng.randrange(3, vocab_size) for _ in range(SHARED)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in SUFFIXES]


def _complete(server, prompt: list[int]) -> tuple[str, int]:
    with server.openai(timeout=300) as client:
        out = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
    return out.choices[0].text, out.usage.prompt_tokens


def _prefill_counts(server) -> dict[str, int]:
    return server.prefill_handle().stats.remote().result()["prefix_cache"]


def _metrics(server) -> dict:
    return scrape(httpx.get(f"{server.base_url}/metrics", timeout=30).text)


def _all_blocks_free(server) -> None:
    wait_decode_settled(server.app)
    wait_for(lambda: not any(server.kv_blocks_in_use().values()), f"every KV block of {server.app} free")


@pytest.fixture(scope="module")
def remote(tandem_server):
    """The session's workers behind a router that sends every prompt to a prefill replica."""
    yield start_router(tandem_server, "always-remote", local_prefill_max_tokens=0)
    stop_router("always-remote")


@pytest.fixture(scope="module")
def no_cache(tandem_server):
    server = start_app(tandem_server, "nocache", enable_prefix_caching=False)
    yield server
    stop_app("nocache")


def test_shared_prefix_is_computed_once_and_changes_no_token(tandem_server, remote, no_cache):
    vocab = tandem_server.prefill_handle().model_info.remote().result().vocab_size
    prompts = _prompts(vocab)

    cached, computed = [], []
    for prompt in prompts:
        before = _prefill_counts(tandem_server)
        text, prompt_tokens = _complete(remote, prompt)
        after = _prefill_counts(tandem_server)
        queried = after["query_tokens"] - before["query_tokens"]
        hits = after["hit_tokens"] - before["hit_tokens"]
        assert queried == prompt_tokens == len(prompt)
        cached.append(text)
        computed.append(queried - hits)
    # The first prompt computes everything; each later one only its own tail, the shared blocks reused.
    assert computed == [SHARED + SUFFIXES[0]] + list(SUFFIXES[1:]), computed

    uncached = [_complete(no_cache, p)[0] for p in prompts]
    assert cached == uncached

    samples = _metrics(tandem_server)  # the prefill replica's running totals, as its stats give them
    hits = worker_value(samples, "tandem_prefix_cache_hits_tokens_total", "prefill")
    assert hits == _prefill_counts(tandem_server)["hit_tokens"] >= SHARED * (len(prompts) - 1)
    assert worker_value(samples, "tandem_prefix_cache_cached_blocks", "prefill") >= SHARED // BLOCK
    assert any(n == "tandem_prefix_cache_queries_tokens_total" and ("role", "decode") in labels
               for n, labels in samples), "the decode group's prefix-cache series"
    off = _metrics(no_cache)
    assert not any(n.startswith("tandem_prefix_cache_") for n, _ in off), "prefix caching off: no series"
    assert _prefill_counts(no_cache) == {}

    _all_blocks_free(tandem_server)
    _all_blocks_free(no_cache)


def test_a_cache_salt_shares_blocks_only_within_its_tenant(tandem_server, remote):
    """vLLM's cache_salt through the API: a salted request reuses nothing of unsalted or other-salted prompts, and
    a second request of its own salt reuses its blocks; the salt changes no token."""
    vocab = tandem_server.prefill_handle().model_info.remote().result().vocab_size
    rng = random.Random(3434)
    prompt = [rng.randrange(3, vocab) for _ in range(SHARED + 5)]

    def computed(salt: str | None) -> tuple[int, str]:
        before = _prefill_counts(tandem_server)
        with remote.openai(timeout=300) as client:
            out = client.completions.create(model=remote.model, prompt=prompt, max_tokens=4, temperature=0,
                                            extra_body={"cache_salt": salt} if salt else None)
        after = _prefill_counts(tandem_server)
        return (after["query_tokens"] - before["query_tokens"]) - (after["hit_tokens"] - before["hit_tokens"]), \
            out.choices[0].text

    plain = computed(None)
    assert plain[0] == len(prompt)  # a prompt nobody sent before
    first_a, second_a, first_b = computed("tenant-a"), computed("tenant-a"), computed("tenant-b")
    assert first_a[0] == len(prompt) and first_b[0] == len(prompt)  # nothing shared across salts
    assert second_a[0] == len(prompt) - SHARED  # its own tenant's blocks are reused
    assert plain[1] == first_a[1] == second_a[1] == first_b[1]
    bad = httpx.post(f"{tandem_server.base_url}/v1/completions", timeout=60, json={
        "model": tandem_server.model, "prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt", bad.text
