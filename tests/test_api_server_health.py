"""The API server answers ``/health`` on its connection thread (web/server.py).

A real cheroot server on a port, raw sockets as clients: what is checked is
what a load balancer's probe sees while the pool threads are all taken.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.support.blocking import blocking_app
from web.server import ApiServer

BODY: dict[str, object] = {"status": "ok", "redis": "ok", "instances": {}}


class _Answer:
    """The inline answer: a fixed body, or None (the app's route answers)."""

    def __init__(self) -> None:
        self.body: dict[str, object] | None = BODY
        self.status = 200
        self.calls = 0

    def __call__(self) -> tuple[int, bytes, dict[str, str]] | None:
        self.calls += 1
        if self.body is None:
            return None
        headers = {} if self.status == 200 else {"Retry-After": "2"}
        return self.status, json.dumps(self.body).encode(), headers


OneThread = tuple[ApiServer, "_Answer", threading.Event, threading.Semaphore]


@pytest.fixture
def one_thread() -> Iterator[OneThread]:
    """A server with one pool thread that cannot grow, and a route that holds it."""
    app, release, inside = blocking_app("inline-health-test")
    answer = _Answer()
    server = ApiServer(app, threads=1, max_threads=1, linger_s=0, inline_health=answer)
    server.start_background()
    try:
        yield server, answer, release, inside
    finally:
        release.set()
        server.shutdown()


def _request(port: int, raw: bytes, timeout_s: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(raw)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def _split(resp: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        fields[k.strip().lower()] = v.strip()
    return lines[0], fields, body


def test_health_is_answered_while_every_pool_thread_is_taken(one_thread: OneThread) -> None:
    server, answer, release, inside = one_thread
    blocked = threading.Thread(
        target=lambda: requests.get(server.url + "/block", timeout=30), daemon=True
    )
    blocked.start()
    assert inside.acquire(timeout=10)  # the only thread is held
    resp = _request(
        server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout_s=5
    )
    status, fields, body = _split(resp)
    assert status == "HTTP/1.1 200 OK"
    assert fields["content-type"] == "application/json"
    assert int(fields["content-length"]) == len(body)
    assert json.loads(body) == BODY
    # the route would have waited for the held thread; it was not asked
    assert answer.calls == 1
    release.set()
    blocked.join(10)


def test_keep_alive_pipelined_and_unhealthy(one_thread: OneThread) -> None:
    server, answer, _release, _inside = one_thread
    answer.status, answer.body = 503, {"status": "degraded", "redis": "ok", "instances": {}}
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        # two probes in one write, then a third on the same connection
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
        reader = s.makefile("rb")
        answers = [_read_one(reader), _read_one(reader)]
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answers.append(_read_one(reader))
    for status, fields, body in answers:
        assert status == "HTTP/1.1 503 Service Unavailable"
        assert fields["retry-after"] == "2"
        assert "connection" not in fields  # kept open
        assert json.loads(body)["status"] == "degraded"
    assert answer.calls == 3


def _read_one(reader: Any) -> tuple[str, dict[str, str], bytes]:
    """One response from a keep-alive connection (framed by Content-Length)."""
    status = reader.readline().decode("latin-1").strip()
    fields = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        fields[k.strip().lower()] = v.strip()
    return status, fields, reader.read(int(fields["content-length"]))


def test_the_route_answers_when_the_server_cannot(one_thread: OneThread) -> None:
    server, answer, _release, _inside = one_thread
    answer.body = None  # e.g. the gateway's copy is old: only the route may ask Redis
    assert requests.get(server.url + "/health", timeout=5).text == "from the route"
    answer.body = BODY
    # anything but a bare GET /health goes to the app as before
    assert requests.get(server.url + "/health?verbose=1", timeout=5).text == "from the route"
    assert requests.post(server.url + "/health", timeout=5).status_code == 405
    assert requests.get(server.url + "/health", timeout=5).json() == BODY


def test_a_silent_connection_holds_no_thread(one_thread: OneThread) -> None:
    """A client that connects and sends nothing waits in the selector: the one
    pool thread still serves the next request at once."""
    server, _answer, release, _inside = one_thread
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):
        release.set()  # /block returns at once now
        assert requests.get(server.url + "/block", timeout=5).text == "done"


def test_the_live_app_answers_health_inline(live_stack: Any) -> None:
    """The live API's own answer: the route's body, from the gateway's copy."""
    with live_stack() as stack:
        inline = stack.app.extensions["tokenfleet.inline_health"]
        via_route = requests.get(stack.url + "/health?route=1", timeout=10)  # not inline
        deadline = time.monotonic() + 10
        while (got := inline()) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the refresh thread's copy is at most a second old, unless it lags
        assert got is not None
        status, body, _headers = got
        assert status == via_route.status_code == 200
        mine, theirs = json.loads(body), via_route.json()
        for doc in (mine, theirs):
            for inst in doc["instances"].values():
                inst.pop("age_s")
            doc.get("ledger", {}).pop("pending", None)  # rows may land between the two reads
        assert mine == theirs
        assert len(mine["instances"]) >= 2
        # and a probe gets it from the server's own thread
        probe = _request(stack.server.port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert json.loads(_split(probe)[2])["status"] == "ok"
