"""A decode cache far too small for its load (a dedicated app with 24 KV blocks per engine): the decode
engine preempts and recomputes, hand-overs wait for room, and every request still ends with the
single-process engine's exact tokens or a typed error, never a hang; afterwards no block is in use."""
from __future__ import annotations

import asyncio

import openai
import pytest

from cluster.testing import wait_for
from decode_worker.config import DecodeConfig
from deploy.testing import start_app, stop_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NUM_KV_BLOCKS = 24  # x 16 tokens: 384 tokens of KV per engine
MAX_TOKENS = 200  # each request ends holding 13 blocks: 8 of them need 104 > 24, so the decode side preempts


@pytest.fixture(scope="module")
def tight(tandem_server):
    server = start_app(tandem_server, "tight", num_kv_blocks=NUM_KV_BLOCKS)
    yield server
    stop_app("tight")


async def complete(client, model: str, prompt: str, stream: bool) -> tuple[str, str]:
    """("completed", text) or ("error", message): an openai.APIError carries the OpenAI error shape."""
    params = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    try:
        if not stream:
            return "completed", (await client.completions.create(**params)).choices[0].text
        return "completed", "".join([c.choices[0].text async for c in await client.completions.create(
            **params, stream=True) if c.choices])
    except openai.APIError as e:
        return "error", str(e)


def test_a_full_cache_preempts_and_every_request_gets_the_engines_tokens(tight):
    from engine import LLM, SamplingParams

    prompts = [f"The quick brown fox {i}" for i in range(8)]
    llm = LLM(tight.model_dir, num_kv_blocks=256)
    want = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                 ignore_eos=True))]
    del llm

    peak = [0]

    async def watch_blocks():
        while True:
            used = await asyncio.to_thread(tight.kv_blocks_in_use)
            peak[0] = max([peak[0]] + [v for k, v in used.items() if k.startswith("decode")])
            await asyncio.sleep(0.2)

    async def main():
        watcher = asyncio.create_task(watch_blocks())
        async with tight.async_openai(timeout=600) as client:
            runs = [complete(client, tight.model, p, stream=i % 2 == 0) for i, p in enumerate(prompts)]
            try:  # a bound on a hang only
                return await asyncio.wait_for(asyncio.gather(*runs), timeout=900)
            except asyncio.TimeoutError:
                raise AssertionError("requests on a full KV cache hang instead of finishing or failing") from None
            finally:
                watcher.cancel()

    outcomes = asyncio.run(main())
    # The decode cache was full (requests gave way to each other): all of it but the hand-over stock, which
    # holds blocks for hand-overs still to come and counts as free.
    stocked = int(NUM_KV_BLOCKS * DecodeConfig.model_fields["handover_stock"].default)
    assert peak[0] >= NUM_KV_BLOCKS - stocked - 2, peak
    for (outcome, text), expected in zip(outcomes, want):
        assert outcome in ("completed", "error"), outcome
        if outcome == "completed":
            assert text == expected
    assert any(o == "completed" for o, _ in outcomes)
    wait_for(lambda: not any(tight.kv_blocks_in_use().values()), "KV blocks in use back to 0", 120, 0.5)
