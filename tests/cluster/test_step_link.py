"""Step links (cluster/step_link.py): the replica <-> rank per-step path over a kept-open socket, its typed
frames, and the protocol version both ends exchange when it opens."""
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

from cluster.errors import ProtocolError, ProtocolVersionError
from cluster.framing import frame, recv_frame
from cluster.protocol import STEP_LINK_VERSION, Command, CommandKind, RankStep, StepReport, TokenDelta
from cluster.protocol import wire
from cluster.step_link import TOKEN_BYTES, RemoteStepError, StepLink, StepLinkError, StepListener


def _listener(handle, token=None, version=STEP_LINK_VERSION):
    token = token or secrets.token_bytes(TOKEN_BYTES)
    return StepListener("127.0.0.1", token, handle, version=version), token


def report(tp_rank: int = 0, **kw) -> StepReport:
    fields = dict(deltas=(), arrived=(), landed=(), failed=(), deferred=(), kv_blocks_used=0, kv_blocks_total=64,
                  num_running=0, step_seconds=0.0)
    return StepReport(tp_rank=tp_rank, **{**fields, **kw})


def step(seq: int, *rids: str) -> RankStep:
    return RankStep(tuple(Command(CommandKind.RESERVE, r) for r in rids), forward=True, reports_tokens=True, seq=seq)


def test_reports_come_back_in_order_with_steps_queued_ahead():
    seen = []

    def handle(work: RankStep, wait_s: float) -> StepReport:
        time.sleep(wait_s)  # the first step is slow: the later ones queue behind it
        seen.append((work.seq, threading.current_thread().name))
        delta = TokenDelta(f"r{work.seq}", tuple(range(work.seq)), work.seq == 5, "stop" if work.seq == 5 else None)
        return report(deltas=(delta,), arrived=tuple(c.request_id for c in work.commands), step_seconds=0.25)

    listener, token = _listener(handle)

    async def main():
        link = await StepLink.open(listener.address, token, "rank 0", 5.0)
        futures = [link.call(step(0), 0.2)] + [link.call(step(i, f"q{i}"), 0.0) for i in range(1, 6)]
        reports = await asyncio.gather(*futures)
        link.close()
        return reports

    reports = asyncio.run(main())
    assert [r.deltas[0].request_id for r in reports] == [f"r{i}" for i in range(6)]
    assert reports[4] == report(deltas=(TokenDelta("r4", (0, 1, 2, 3), False, None),), arrived=("q4",),
                                step_seconds=0.25)
    assert reports[5].deltas[0].finished and reports[5].deltas[0].finish_reason == "stop"
    assert [s for s, _ in seen] == list(range(6))  # run in order, on the listener's one thread
    assert len({name for _, name in seen}) == 1
    listener.close()


def test_a_failing_step_is_reported_and_the_link_keeps_serving():
    def handle(work: RankStep, wait_s: float) -> StepReport:
        if work.commands:
            raise ValueError(f"no such request {work.commands[0].request_id}")
        return report(tp_rank=work.seq)

    listener, token = _listener(handle)

    async def main():
        link = await StepLink.open(listener.address, token, "rank 1", 5.0)
        bad, good = link.call(step(0, "r7")), link.call(step(1))
        with pytest.raises(RemoteStepError, match="ValueError: no such request r7"):
            await bad
        assert (await good).tp_rank == 1
        link.close()

    asyncio.run(main())
    listener.close()


def test_a_client_without_the_token_is_dropped_and_the_replica_still_connects():
    listener, token = _listener(lambda work, wait_s: report(tp_rank=41))
    stray = socket.create_connection(listener.address)
    stray.sendall(b"x" * TOKEN_BYTES)
    stray.settimeout(5)
    assert stray.recv(1) == b""  # closed on it, unanswered
    stray.close()

    async def main():
        link = await StepLink.open(listener.address, token, "rank 0", 5.0)
        assert (await link.call(step(0))).tp_rank == 41
        link.close()

    asyncio.run(main())
    listener.close()


def test_a_rank_closing_its_link_fails_the_step_waiting_on_it_and_every_later_one():
    started = threading.Event()

    def handle(work, wait_s):
        started.set()
        time.sleep(30)  # never answers in time

    listener, token = _listener(handle)

    async def main():
        link = await StepLink.open(listener.address, token, "rank 0", 5.0)
        waiting = link.call(step(0))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        listener.close()
        # The link's own error, while the step still sleeps: not a deadline (wait_for would raise TimeoutError).
        with pytest.raises(StepLinkError, match="closed its step link"):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(StepLinkError):
            await link.call(step(1))
        link.close()

    asyncio.run(main())


def _rank_process(token: bytes, version: int) -> subprocess.Popen:
    """A rank's listener in a process of its own, speaking step link protocol `version`."""
    code = textwrap.dedent(f"""
        import time
        from cluster.step_link import StepListener
        listener = StepListener("127.0.0.1", bytes.fromhex("{token.hex()}"), lambda s, w: time.sleep(60),
                                version={version})
        print(listener.address[1], flush=True)
        time.sleep(60)
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_dead_rank_process_fails_its_step_with_the_links_error_not_a_deadline():
    token = secrets.token_bytes(TOKEN_BYTES)
    proc = _rank_process(token, STEP_LINK_VERSION)
    try:
        port = int(proc.stdout.readline())

        async def main():
            link = await StepLink.open(("127.0.0.1", port), token, "rank 3", 5.0)
            waiting = link.call(step(0))
            await asyncio.sleep(0.3)  # the step is running in the other process
            proc.kill()
            # The step would sleep 60 s: the link's error, not a deadline, ends the wait.
            with pytest.raises(StepLinkError, match="rank 3 closed its step link"):
                await asyncio.wait_for(waiting, 10)

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_a_rank_of_another_version_is_refused_when_the_link_opens():
    """A replica and a rank process of different Tandem versions: a typed error at connect time, naming both
    versions, before any step is sent."""
    token = secrets.token_bytes(TOKEN_BYTES)
    proc = _rank_process(token, STEP_LINK_VERSION + 1)
    try:
        port = int(proc.stdout.readline())
        expected = f"rank 2 speaks step link protocol version {STEP_LINK_VERSION + 1}, this side speaks"
        with pytest.raises(ProtocolVersionError, match=f"{expected} {STEP_LINK_VERSION}"):
            asyncio.run(StepLink.open(("127.0.0.1", port), token, "rank 2", 5.0))
    finally:
        proc.kill()
        proc.wait()


def test_a_replica_of_another_version_gets_the_ranks_hello_and_then_a_closed_link():
    """The rank's side of a mismatch: it answers with its own hello (so the replica can say why) and serves
    nothing."""
    served = []
    listener, token = _listener(lambda work, wait_s: served.append(work) or report())
    sock = socket.create_connection(listener.address)
    sock.settimeout(5)
    sock.sendall(token + frame(wire.hello("step", STEP_LINK_VERSION + 7)))
    assert recv_frame(sock, "hello") == wire.hello("step", STEP_LINK_VERSION)
    try:  # the rank closes after its hello: under load the step's bytes may meet a closed socket (a reset)
        sock.sendall(frame((step(0).to_wire(), 0.0)))
        assert sock.recv(1) == b""  # closed: the step was never run
    except ConnectionResetError:
        pass
    sock.close()
    assert served == []
    listener.close()


def test_a_malformed_report_fails_its_step_with_a_protocol_error_naming_the_field():
    """A rank sending a report whose field has the wrong type (a bug, or another build): that step fails with
    a ProtocolError, not an AttributeError somewhere in the controller."""
    server = socket.create_server(("127.0.0.1", 0))
    token = secrets.token_bytes(TOKEN_BYTES)

    def fake_rank():
        conn, _ = server.accept()
        conn.settimeout(5)
        conn.recv(TOKEN_BYTES)
        recv_frame(conn, "hello")
        conn.sendall(frame(wire.hello("step", STEP_LINK_VERSION)))
        recv_frame(conn, "step")
        bad = list(report().to_wire())
        bad[StepReport.WIRE.index("kv_blocks_used")] = "12"
        conn.sendall(frame(("ok", tuple(bad))))
        time.sleep(1)
        conn.close()

    thread = threading.Thread(target=fake_rank, daemon=True)
    thread.start()

    async def main():
        link = await StepLink.open(server.getsockname(), token, "rank 0", 5.0)
        with pytest.raises(ProtocolError, match="StepReport field 'kv_blocks_used' must be an int, got '12'"):
            await link.call(step(0))
        link.close()

    asyncio.run(main())
    thread.join(5)
    server.close()


def test_an_unreachable_rank_is_a_typed_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it is closed

    async def main():
        await StepLink.open(("127.0.0.1", port), b"t" * TOKEN_BYTES, "rank 0", 2.0)

    with pytest.raises(StepLinkError, match="cannot reach rank 0"):
        asyncio.run(main())
