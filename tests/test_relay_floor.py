"""The bare relay of ``benchmarks/relay_floor.py`` forwards answers whole: the
CPU floor it measures is only worth quoting if it does the relay's job."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from benchmarks.relay_floor import BareRelay

EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]


def _engine(lsock: socket.socket, served: list[int]) -> None:
    """A keep-alive HTTP/1.1 server answering each POST with a chunked event
    stream, one event per chunk, a few ms apart; its request id ends in "0",
    so its head ends as the last chunk does ("0\\r\\n\\r\\n")."""
    conn, _ = lsock.accept()
    f = conn.makefile("rb")
    while True:
        line = f.readline()
        if not line:
            return
        length = 0
        while (h := f.readline()) not in (b"\r\n", b""):
            if h.lower().startswith(b"content-length:"):
                length = int(h.split(b":")[1])
        json.loads(f.read(length))
        served.append(length)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nX-Request-Id: req-%d0\r\n\r\n" % len(served)
        )
        for ev in EVENTS:
            time.sleep(0.004)
            conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
        conn.sendall(b"0\r\n\r\n")


@pytest.fixture(params=[0.0, 0.02], ids=["every-write", "20ms-grid"])
def relay(request: pytest.FixtureRequest) -> Iterator[tuple[int, BareRelay, list[int]]]:
    lsock = socket.create_server(("127.0.0.1", 0))
    served: list[int] = []
    threading.Thread(target=_engine, args=(lsock, served), daemon=True).start()
    port = lsock.getsockname()[1]
    r = BareRelay(0, [f"http://127.0.0.1:{port}"], request.param)
    stop = threading.Event()
    t = threading.Thread(target=r.run, args=(stop,), daemon=True)
    t.start()
    yield r.lsock.getsockname()[1], r, served
    stop.set()
    t.join(5)
    lsock.close()


def test_the_bare_relay_forwards_each_streamed_answer_whole_on_kept_connections(
    relay: tuple[int, BareRelay, list[int]],
) -> None:
    port, r, served = relay
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for i in range(3):
        body = json.dumps({"i": i, "pad": "x" * 5000}).encode()
        client.request("POST", "/v1/chat/completions", body=body)
        resp = client.getresponse()
        assert resp.status == 200
        assert resp.read() == b"".join(EVENTS)  # nothing lost, nothing from the next
    assert len(served) == 3  # one upstream connection, kept alive, served all three
    assert r.stats["requests"] == 3
    assert r.stats["engine_reads"] >= 3
