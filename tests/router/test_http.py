"""The OpenAI HTTP API end to end (router -> prefill -> KV hand-over -> tp=2 decode group), through the
official `openai` client, against the single-process engine on the same prompts."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.ray

PROMPTS = ["Hello, how are you?", "The quick brown fox", "def add(a, b):", "Grüße aus Köln",
           "Tandem serves models on Ray.", "lazy dog", "return a + b", "naïve café"]


@pytest.fixture(scope="module")
def reference(tandem_server):
    """prompt text or chat messages -> the single-process engine's output for the same params."""
    from engine import LLM, SamplingParams

    llm = LLM(tandem_server.model_dir, num_kv_blocks=256)

    def run(prompt, **params):
        if isinstance(prompt, list) and isinstance(prompt[0], dict):  # chat: the template the router applies
            text = llm.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        return llm.generate([prompt], SamplingParams(**params))[0]

    return run


def test_greedy_completions_match_the_single_process_engine(tandem_server, reference):
    client = tandem_server.openai()
    for prompt in PROMPTS[:4]:
        want = reference(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
        got = client.completions.create(model=tandem_server.model, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids) == 24
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.choices[0].finish_reason == "length"
        assert got.id.startswith("cmpl-")


def test_token_id_prompts_and_logprobs(tandem_server, reference):
    client = tandem_server.openai()
    want = reference([5, 9, 22, 41, 8, 120, 7], max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    got = client.completions.create(model=tandem_server.model, prompt=[5, 9, 22, 41, 8, 120, 7], max_tokens=8,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert got.choices[0].text == want.text
    assert len(lp.token_logprobs) == 8 and all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)


def test_seeded_sampling_survives_the_hand_over(tandem_server, reference):
    """Sampling depends on (seed, position) only: the decode group continues the prefill's stream."""
    client = tandem_server.openai()
    want = reference(PROMPTS[1], max_tokens=16, temperature=0.9, seed=1234, ignore_eos=True)
    texts = {client.completions.create(model=tandem_server.model, prompt=PROMPTS[1], max_tokens=16,
                                       temperature=0.9, seed=1234, extra_body={"ignore_eos": True}).choices[0].text
             for _ in range(2)}
    assert texts == {want.text}


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_and_non_streaming_give_the_same_text(tandem_server, reference, chat):
    client = tandem_server.openai()
    kw = dict(model=tandem_server.model, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    if chat:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        full = client.chat.completions.create(messages=messages, **kw)
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **kw))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        text = full.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
        assert text == reference(messages, max_tokens=20, temperature=0.0, ignore_eos=True).text
    else:
        full = client.completions.create(prompt=PROMPTS[2], **kw)
        chunks = list(client.completions.create(prompt=PROMPTS[2], stream=True,
                                                stream_options={"include_usage": True}, **kw))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        text = full.choices[0].text
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20
    assert len({c.id for c in chunks}) == 1


def test_stop_strings_end_the_output(tandem_server, reference):
    client = tandem_server.openai()
    want = reference(PROMPTS[0], max_tokens=24, temperature=0.0, ignore_eos=True)
    stop = want.text[6:9]
    assert stop and stop in want.text
    cut = want.text[: want.text.index(stop)]
    for stream in (False, True):
        resp = client.completions.create(model=tandem_server.model, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                         stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(resp)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = resp.choices[0].text, resp.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")


def test_32_concurrent_requests_all_complete_correctly(tandem_server, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    lengths = [8 + (i % 5) * 4 for i in range(32)]
    want = [reference(p, max_tokens=n, temperature=0.0, ignore_eos=True).text for p, n in zip(prompts, lengths)]

    async def one(client, i):
        kw = dict(model=tandem_server.model, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                  extra_body={"ignore_eos": True})
        if i % 2:
            stream = await client.completions.create(stream=True, **kw)
            return "".join([c.choices[0].text async for c in stream])
        return (await client.completions.create(**kw)).choices[0].text

    async def main():
        async with tandem_server.async_openai(timeout=120) as client:
            return await asyncio.gather(*[one(client, i) for i in range(32)])

    decode = tandem_server.decode_handle()
    before = decode.stats.remote().result()
    assert asyncio.run(main()) == want
    after = decode.stats.remote().result()
    # The decode side's tokens reach the router on one feed stream, a batch per step for all the requests
    # decoding together, not one stream item per request per step.
    items, batches = after["feed_items"] - before["feed_items"], after["feed_batches"] - before["feed_batches"]
    assert items >= 32 and items / batches >= 2, (items, batches)


BAD = [
    ("malformed JSON", b'{"model": "tiny", "prompt": "x",', "completions", None),
    ("too-long prompt", {"model": "tiny", "prompt": "fox " * 4000}, "completions", "prompt"),  # > 1024 positions
    ("prompt + max_tokens too long", {"model": "tiny", "prompt": "x", "max_tokens": 10_000}, "completions", "max_tokens"),
    ("negative temperature", {"model": "tiny", "prompt": "x", "temperature": -1}, "completions", "temperature"),
    ("top_p zero", {"model": "tiny", "prompt": "x", "top_p": 0}, "completions", "top_p"),
    ("zero max_tokens", {"model": "tiny", "prompt": "x", "max_tokens": 0}, "completions", "max_tokens"),
    ("n=0", {"model": "tiny", "prompt": "x", "n": 0}, "completions", "n"),
    ("token id out of vocab", {"model": "tiny", "prompt": [1, 2, 999999]}, "completions", "prompt"),
    ("wrong type", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, "completions", "max_tokens"),
    ("missing messages", {"model": "tiny"}, "chat/completions", "messages"),
    ("bad role", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, "chat/completions",
     "messages.0.role"),
    ("bad logprobs", {"model": "tiny", "prompt": "x", "logprobs": 99}, "completions", "logprobs"),
]


def test_bad_requests_get_400_without_disturbing_good_ones(tandem_server, reference):
    good_prompts = PROMPTS[:6]
    want = [reference(p, max_tokens=16, temperature=0.0, ignore_eos=True).text for p in good_prompts]

    async def good(client, prompt):
        stream = await client.completions.create(model=tandem_server.model, prompt=prompt, max_tokens=16,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def bad(http, body, path):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await http.post(f"/v1/{path}", content=content, headers={"Content-Type": "application/json"})

    async def main():
        async with tandem_server.async_openai(timeout=120) as client, \
                httpx.AsyncClient(base_url=tandem_server.base_url, timeout=60) as http:
            goods = [asyncio.create_task(good(client, p)) for p in good_prompts]
            bads = await asyncio.gather(*[bad(http, body, path) for _, body, path, _ in BAD for _ in range(2)])
            return await asyncio.gather(*goods), bads

    texts, responses = asyncio.run(main())
    assert texts == want
    for (name, _, _, param), resp in zip([b for b in BAD for _ in range(2)], responses):
        assert resp.status_code == 400, (name, resp.text)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", name
        assert err["message"], name
        if param is not None:
            assert err["param"] == param, (name, err)


def test_unknown_model_through_the_openai_client(tandem_server):
    with pytest.raises(openai.NotFoundError) as e:
        tandem_server.openai().completions.create(model="nope", prompt="x")
    assert e.value.body["code"] == "model_not_found"


def test_models_health_and_metrics(tandem_server):
    client = tandem_server.openai()
    (model,) = client.models.list().data
    assert model.id == tandem_server.model
    with httpx.Client(base_url=tandem_server.base_url) as http:
        assert http.get("/health").json() == {"status": "ok"}
        client.completions.create(model=tandem_server.model, prompt="Hello", max_tokens=4, temperature=0)
        text = http.get("/metrics").text
    for name in ("tandem_requests_total", "tandem_time_to_first_token_seconds_bucket",
                 "tandem_inter_token_latency_seconds_bucket", "tandem_prompt_tokens_total",
                 "tandem_generation_tokens_total", "tandem_kv_blocks_used", "tandem_kv_cache_usage",
                 "tandem_queue_length", "tandem_worker_queue_length"):
        assert name in text, name
    assert 'role="decode"' in text and 'role="prefill"' in text


def test_overload_beyond_the_queue_bound_gets_429(tandem_server):
    bound = tandem_server.config.max_inflight
    n = bound + 12

    async def one(http, i):
        return await http.post("/v1/completions", json={"model": tandem_server.model, "prompt": PROMPTS[i % 8],
                                                        "max_tokens": 48, "temperature": 0, "ignore_eos": True})

    async def main():
        async with httpx.AsyncClient(base_url=tandem_server.base_url, timeout=180,
                                     limits=httpx.Limits(max_connections=n)) as http:
            return await asyncio.gather(*[one(http, i) for i in range(n)])

    statuses = [r.status_code for r in asyncio.run(main())]
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) >= 1 and statuses.count(200) >= bound // 2
    assert 0 < statuses.count(200) <= bound
