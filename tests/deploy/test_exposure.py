"""`tandem serve` as `make serve` starts it has no side doors. Every listener of its process tree (Ray's
GCS, raylet, workers, agents and metrics servers; Tandem's step and feed links, gloo pairs; the OpenAI port)
is on loopback, except what a component will not bind elsewhere: Ray Serve's inter-deployment gRPC server in
each replica listens on every interface (hard-coded in Ray), and must then refuse a caller without Ray's
token. No decode rank holds a TCPStore (its rendezvous goes through Ray: cluster/rendezvous.py)."""
from __future__ import annotations

import pytest

from tests.support.listeners import (Verdict, answers, is_loopback, knock_all, listeners, refuses_without_token,
                                     routable_addresses)
from tests.support.served import tandem_serve

pytestmark = pytest.mark.slow


def test_every_listener_of_tandem_serve_is_on_loopback(tiny_model_dir):
    import httpx

    with tandem_serve("--model", tiny_model_dir) as server:
        # A request first: the hand-over channel and its gloo pairs exist only once one has crossed.
        model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        answer = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        found = listeners(server.pid)
        names = {entry.process for entry in found}
        assert len(found) >= 8 and {"gcs_server", "raylet"} <= names, found  # the whole tree was seen
        exposed = [entry for entry in found if not is_loopback(entry.host)]
        assert all(entry.process.startswith("ray::ServeReplica") for entry in exposed), \
            f"listeners beyond loopback: {exposed}"
        open_doors = [entry for entry in exposed if not refuses_without_token("127.0.0.1", entry.port)]
        assert not open_doors, f"answered a caller without Ray's token: {open_doors}"
        credentialed = {entry.port for entry in exposed}
        knocked = [(host, entry.port) for host in routable_addresses() for entry in found
                   if entry.port not in credentialed and answers(host, entry.port)]
        assert not knocked, f"answered from the network: {knocked}"
        ranks = [entry for entry in found if entry.process == "ray::DecodeRank"]
        assert ranks, names
        # Regression (issue 39): each rank's rendezvous was a TCPStore, which answers any client.
        # Now a rank's listeners are its core worker's gRPC server, its step link and gloo pairs.
        verdicts = {k.verdict for k in knock_all(ranks, "127.0.0.1")}
        assert verdicts <= {Verdict.GRPC_REFUSED, Verdict.SILENT, Verdict.CLOSED}, verdicts
