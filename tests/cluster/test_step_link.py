"""Step links (cluster/step_link.py): the replica <-> rank per-step path over a kept-open socket."""
from __future__ import annotations

import asyncio
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cluster.step_link import TOKEN_BYTES, RemoteStepError, StepLink, StepLinkError, StepListener


def _listener(handle, token=None):
    token = token or secrets.token_bytes(TOKEN_BYTES)
    return StepListener("127.0.0.1", token, handle), token


def test_replies_come_back_in_order_with_steps_queued_ahead():
    seen = []

    def handle(request):
        seq, wait_s = request
        time.sleep(wait_s)  # the first step is slow: the later ones queue behind it
        seen.append((seq, threading.current_thread().name))
        return {"seq": seq, "tokens": list(range(seq))}

    listener, token = _listener(handle)

    async def main():
        link = await StepLink.open(listener.address, token, "rank 0", 5.0)
        futures = [link.call((0, 0.2))] + [link.call((i, 0.0)) for i in range(1, 6)]
        replies = await asyncio.gather(*futures)
        link.close()
        return replies

    replies = asyncio.run(main())
    assert [r["seq"] for r in replies] == list(range(6))
    assert replies[4]["tokens"] == [0, 1, 2, 3]
    assert [s for s, _ in seen] == list(range(6))  # run in order, on the listener's one thread
    assert len({name for _, name in seen}) == 1
    listener.close()


def test_a_failing_step_is_reported_and_the_link_keeps_serving():
    def handle(request):
        if request == "bad":
            raise ValueError("no such request r7")
        return request.upper()

    listener, token = _listener(handle)

    async def main():
        link = await StepLink.open(listener.address, token, "rank 1", 5.0)
        bad, good = link.call("bad"), link.call("next")
        with pytest.raises(RemoteStepError, match="ValueError: no such request r7"):
            await bad
        assert await good == "NEXT"
        link.close()

    asyncio.run(main())
    listener.close()


def test_a_client_without_the_token_is_dropped_and_the_replica_still_connects():
    listener, token = _listener(lambda r: r)
    stray = socket.create_connection(listener.address)
    stray.sendall(b"x" * TOKEN_BYTES)
    stray.settimeout(5)
    assert stray.recv(1) == b""  # closed on it, unanswered
    stray.close()

    async def main():
        link = await StepLink.open(listener.address, token, "rank 0", 5.0)
        assert await link.call(41) == 41
        link.close()

    asyncio.run(main())
    listener.close()


def test_a_rank_closing_its_link_fails_the_step_waiting_on_it_and_every_later_one():
    started = threading.Event()

    def handle(request):
        started.set()
        time.sleep(30)  # never answers in time

    listener, token = _listener(handle)

    async def main():
        link = await StepLink.open(listener.address, token, "rank 0", 5.0)
        waiting = link.call("step")
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        listener.close()
        # The link's own error, while the step still sleeps: not a deadline (wait_for would raise TimeoutError).
        with pytest.raises(StepLinkError, match="closed its step link"):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(StepLinkError):
            await link.call("after")
        link.close()

    asyncio.run(main())


def test_a_dead_rank_process_fails_its_step_with_the_links_error_not_a_deadline():
    token = secrets.token_bytes(TOKEN_BYTES)
    code = textwrap.dedent(f"""
        import sys, time
        from cluster.step_link import StepListener
        listener = StepListener("127.0.0.1", bytes.fromhex("{token.hex()}"), lambda r: time.sleep(60))
        print(listener.address[1], flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())

        async def main():
            link = await StepLink.open(("127.0.0.1", port), token, "rank 3", 5.0)
            waiting = link.call("step")
            await asyncio.sleep(0.3)  # the step is running in the other process
            proc.kill()
            # The step would sleep 60 s: the link's error, not a deadline, ends the wait.
            with pytest.raises(StepLinkError, match="rank 3 closed its step link"):
                await asyncio.wait_for(waiting, 10)

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_an_unreachable_rank_is_a_typed_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it is closed

    async def main():
        await StepLink.open(("127.0.0.1", port), b"t" * TOKEN_BYTES, "rank 0", 2.0)

    with pytest.raises(StepLinkError, match="cannot reach rank 0"):
        asyncio.run(main())
