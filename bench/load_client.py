"""The client side of the soak and the fault runs against a running `tandem serve`: one request sent and
its outcome classified (completed, a typed error, hung, disconnected, unexplained), and the server's state
read back: KV blocks in use per replica from /metrics, the process tree and its resident memory from /proc.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import httpx


# short prompts in several scripts, for requests whose text does not matter
PROMPTS = ["Hello, how are you?", "The quick brown fox", "def add(a, b):", "Grüße aus Köln", "Once upon a time",
           "Tandem serves models on Ray.", "naïve café", "return a + b"]


# ---------------------------------------------------------------------------------------------- one request
def _typed(payload) -> bool:
    err = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err) and bool(err["message"])


async def send_request(http: httpx.AsyncClient, spec: dict, deadline_s: float) -> dict:
    """The outcome of one request: {outcome, status, latency_s, ttft_s, detail, started (perf_counter), and for a
    stream max_gap_s}."""
    start = time.perf_counter()
    out: dict = {"kind": spec["kind"], "outcome": None, "status": None, "latency_s": None, "ttft_s": None,
                 "started": start}
    timeout = httpx.Timeout(0.05) if spec["kind"] == "timeout" else httpx.Timeout(deadline_s)
    try:
        if not spec["stream"]:
            resp = await asyncio.wait_for(http.post(spec["path"], json=spec["body"], timeout=timeout,
                                                    headers=spec.get("headers")), deadline_s)
            out["status"] = resp.status_code
            payload = _json(resp.text)
            if resp.status_code == 200 and payload.get("choices") and payload["choices"][0].get("finish_reason"):
                out["outcome"] = "completed"
            elif resp.status_code >= 400 and _typed(payload):
                out["outcome"], out["detail"] = "typed_error", payload["error"]
            else:
                out["outcome"], out["detail"] = "unexplained", resp.text[:300]
        else:
            out.update(await asyncio.wait_for(_stream(http, spec, timeout, start), deadline_s))
    except asyncio.TimeoutError:
        out["outcome"] = "hung"
    except httpx.TimeoutException:
        out["outcome"] = "client_timeout" if spec["kind"] == "timeout" else "hung"
    except httpx.HTTPError as e:
        out["outcome"], out["detail"] = "unexplained", f"{type(e).__name__}: {e}"
    out["latency_s"] = time.perf_counter() - start
    return out


async def _stream(http: httpx.AsyncClient, spec: dict, timeout, start: float) -> dict:
    """... and max_gap_s: the longest wait between two events of the stream (a resumed stream's pause)."""
    out: dict = {"outcome": "unexplained", "detail": "the stream ended without [DONE]", "max_gap_s": 0.0}
    chunks = 0
    finish = None
    last = None
    async with http.stream("POST", spec["path"], json=spec["body"], timeout=timeout,
                           headers=spec.get("headers")) as resp:
        out["status"] = resp.status_code
        if resp.status_code != 200:
            payload = _json((await resp.aread()).decode(errors="replace"))
            ok = _typed(payload)
            return {**out, "outcome": "typed_error" if ok else "unexplained", "detail": payload.get("error")}
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if last is not None:
                out["max_gap_s"] = max(out["max_gap_s"], now - last)
            last = now
            if line == "data: [DONE]":
                done = finish is not None
                return {**out, "outcome": "completed" if done else "unexplained",
                        "detail": None if done else "[DONE] without a finish_reason"}
            payload = _json(line[6:])
            if "error" in payload:
                return {**out, "outcome": "typed_error" if _typed(payload) else "unexplained",
                        "detail": payload.get("error")}
            for choice in payload.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                if out.get("ttft_s") is None:
                    out["ttft_s"] = time.perf_counter() - start
            chunks += 1
            if spec["kind"] == "disconnect" and chunks >= 2:
                return {**out, "outcome": "disconnected", "detail": None}  # leaving the block closes it
    return out


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------------------------- server state
def kv_blocks_used(metrics_text: str, metric: str = "tandem_kv_blocks_used") -> dict[str, float]:
    """{"role/replica": blocks} from /metrics (or another per-worker gauge: `metric`)."""
    used = {}
    for m in re.finditer(rf'^{metric}\{{([^}}]*)\}} ([0-9.eE+-]+)$', metrics_text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        used[f"{labels.get('role')}/{labels.get('replica')}"] = float(m.group(2))
    return used


async def wait_for_free_blocks(http: httpx.AsyncClient, within_s: float) -> tuple[dict[str, float], float]:
    """KV blocks in use per replica once all are 0 (or when `within_s` ran out), and how long that took."""
    start = time.monotonic()
    while True:
        used = kv_blocks_used((await http.get("/metrics", timeout=30)).text)
        if (used and not any(used.values())) or time.monotonic() - start > within_s:
            return used, time.monotonic() - start
        await asyncio.sleep(0.5)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (with an embedded Ray: the raylet, its workers and actors)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def tree_rss_mb(pid: int | None) -> float | None:
    """Resident memory of `pid` and every process below it (Ray's raylet, workers, actors), in MB."""
    if pid is None:
        return None
    total = 0
    for p in process_tree(pid):
        try:
            rss = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{p}/status").read_text())
        except OSError:
            continue
        total += int(rss.group(1)) if rss else 0
    return total / 1024
