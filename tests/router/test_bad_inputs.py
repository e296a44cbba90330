"""The bad-input corpus (tests/router/bad_inputs.jsonl, one case a line) over HTTP against the session's
server, with good requests streaming alongside: each case gets its documented status and the OpenAI error
shape, and the server still answers good requests afterwards.

A case: `kind` (what is wrong), `endpoint` ("METHOD /path"), the request as `body` (JSON), `raw` (text
sent as is) or `raw_b64` (bytes, for invalid UTF-8), optional `pad_prompt_to_bytes` (the body's prompt is
padded to that size: huge bodies stay out of the file), `chunked` (sent without Content-Length), `fill`
({at: [keys], item, count}: a long list built at run time; a string item is formatted with {i}), `repeat`
({at: [keys], text, times}: a long string), and `expect`: status, error
type, and, where present, param and code. A few hostile inputs the server can serve (regexes that look
pathological but compile in milliseconds) expect 200: what matters is that they are answered.
"""
from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.ray

CORPUS = Path(__file__).with_name("bad_inputs.jsonl")
GOOD_PROMPTS = ["Hello, how are you?", "The quick brown fox", "def add(a, b):", "Grüße aus Köln"]


def load_corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def request_of(case: dict) -> tuple[str, str, bytes | object, dict]:
    """(method, path, content, headers) of a case; content is an iterator of chunks for `chunked`."""
    method, path = case["endpoint"].split(" ", 1)
    headers = {"Content-Type": "application/json"}
    if "raw_b64" in case:
        return method, path, base64.b64decode(case["raw_b64"]), headers
    if "raw" in case:
        return method, path, case["raw"].encode(), headers
    body = json.loads(json.dumps(case.get("body", {})))
    if "fill" in case:
        fill = case["fill"]
        item = fill["item"]
        _put(body, fill["at"], [item.format(i=i) if isinstance(item, str) else item for i in range(fill["count"])])
    if "repeat" in case:
        _put(body, case["repeat"]["at"], case["repeat"]["text"] * case["repeat"]["times"])
    if "pad_prompt_to_bytes" in case:
        body["prompt"] = "x" * case["pad_prompt_to_bytes"]
    content = json.dumps(body).encode()
    if case.get("chunked"):
        step = 1 << 20
        chunks = [content[i:i + step] for i in range(0, len(content), step)]
        return method, path, iter(chunks), headers
    return method, path, content, headers


def _put(body: dict, path: list, value) -> None:
    for key in path[:-1]:
        body = body[key]
    body[path[-1]] = value


async def send(http: httpx.AsyncClient, case: dict) -> httpx.Response:
    method, path, content, headers = request_of(case)
    if not isinstance(content, bytes):
        chunks = list(content)

        async def stream():
            for c in chunks:
                yield c
        content = stream()
    return await http.request(method, path, content=content, headers=headers)


def check(case: dict, resp: httpx.Response) -> str | None:
    """What is wrong with the answer to a case (None: it is what the corpus documents)."""
    want = case["expect"]
    if resp.status_code != want["status"]:
        return f"status {resp.status_code}, want {want['status']}: {resp.text[:300]}"
    if resp.status_code < 400:  # hostile but servable (a regex that looks pathological, compiled quickly)
        return None
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not the OpenAI error shape: {resp.text[:300]}"
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err) if isinstance(err, dict) else err!r}"
    if not err["message"] or err["type"] != want["type"]:
        return f"type {err['type']!r}, want {want['type']!r} ({err['message']!r})"
    for key in ("param", "code"):
        if key in want and err[key] != want[key]:
            return f"{key} {err[key]!r}, want {want[key]!r} ({err['message']!r})"
    if want["status"] == 429 and "retry-after" not in resp.headers:
        return "429 without Retry-After"
    return None


async def run_corpus(base_url: str, model: str, cases: list[dict]) -> tuple[dict[str, str], list[str]]:
    """Every case, with good requests streaming alongside and one good request after every 10 cases:
    ({kind: what is wrong}, the good outputs)."""
    import openai

    async def good(client, prompt):
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    wrong: dict[str, str] = {}
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120) as client, \
            httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        alongside = [asyncio.create_task(good(client, p)) for p in GOOD_PROMPTS]
        interleaved = []
        for i, case in enumerate(cases):
            problem = check(case, await send(http, case))
            if problem:
                wrong[case["kind"]] = problem
            if i % 10 == 9:
                interleaved.append(await good(client, GOOD_PROMPTS[i % len(GOOD_PROMPTS)]))
        return wrong, await asyncio.gather(*alongside) + interleaved


def test_the_corpus_has_at_least_50_kinds_each_documented():
    cases = load_corpus()
    kinds = [c["kind"] for c in cases]
    assert len(set(kinds)) == len(kinds)
    assert sum(c["expect"]["status"] >= 400 for c in cases) >= 50
    for case in cases:
        assert {"kind", "endpoint", "expect"} <= set(case) and "status" in case["expect"], case["kind"]
        assert sum(k in case for k in ("body", "raw", "raw_b64")) <= 1, case["kind"]


def test_every_bad_input_gets_its_documented_error_and_good_requests_still_complete(tandem_server):
    from engine import LLM, SamplingParams

    cases = load_corpus()
    wrong, outputs = asyncio.run(run_corpus(tandem_server.base_url, tandem_server.model, cases))
    assert wrong == {}
    llm = LLM(tandem_server.model_dir, num_kv_blocks=64)
    want = {p: llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].text
            for p in GOOD_PROMPTS}
    n_after = len(outputs) - len(GOOD_PROMPTS)
    assert outputs == [want[p] for p in GOOD_PROMPTS] + [want[GOOD_PROMPTS[(10 * j + 9) % 4]] for j in range(n_after)]
    with httpx.Client(base_url=tandem_server.base_url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}
