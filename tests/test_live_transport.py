"""The live path's plumbing: our kombu Redis channel, the API server, the bench client.

All against real servers: the embedded Redis, a real Celery producer and
kombu consumer, cheroot serving a Flask app, a TCP server that drops idle
connections.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from flask import Flask, Response

from tokenfleet.live.config import LiveConfig
from tokenfleet.live.httpclient import KeepAliveClient
from tokenfleet.live.jobs import TASK_CHAT
from tokenfleet.live.redis_transport import (
    Channel,
    PipelinePublisher,
    publishes_into,
    same_database,
)
from web.server import LINGER_S, ApiServer
from workers.app import create_celery


def test_same_database_normalises_urls() -> None:
    assert same_database("redis://127.0.0.1:6379", "redis://127.0.0.1:6379/0")
    assert not same_database("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379/0")
    assert not same_database("redis://127.0.0.1:6379", "redis://127.0.0.1:6380")
    assert not same_database("rediss://h:1", "redis://h:1")
    assert not same_database("redis://:a@h:1", "redis://:b@h:1")


@pytest.fixture()
def celery_app(redis_server: Any) -> Iterator[Any]:
    app = create_celery(redis_server.url, LiveConfig())
    yield app
    app.close()


def test_channel_reuses_one_client_per_pool(celery_app: Any) -> None:
    with celery_app.connection_for_write() as conn:
        ch = conn.default_channel
        assert isinstance(ch, Channel)
        with ch.conn_or_acquire() as a, ch.conn_or_acquire() as b:
            assert a is b
        ch._disconnect_pools()  # what kombu does on reconnect and after fork
        with ch.conn_or_acquire() as c:
            assert c is not a
            assert c.connection_pool is ch.pool
            assert c.ping()


def _queued(r: redis.Redis, queue: str) -> int:
    return int(r.llen(queue))


def _take(celery_app: Any, queue: str, n: int) -> list[tuple[Any, Any]]:
    """(headers, body) of up to ``n`` messages a kombu consumer takes from ``queue``."""
    from kombu import Queue

    got: list[tuple[Any, Any]] = []
    with (
        celery_app.connection_for_read() as conn,
        conn.Consumer(
            Queue(queue, routing_key=queue),
            accept=["json"],
            callbacks=[lambda body, msg: (got.append((msg.headers, body)), msg.ack())],
        ),
    ):
        deadline = time.monotonic() + 5
        while len(got) < n and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
    return got


def test_publish_joins_the_pipeline_and_is_consumable(celery_app: Any, redis_server: Any) -> None:
    """The LPUSH waits for the caller's pipeline, lands after the writes queued
    before it, and is a normal Celery message a kombu consumer can take."""
    r = redis.Redis.from_url(redis_server.url)
    queue = "test-dc.interactive"
    r.delete(queue, "marker")
    pipe = r.pipeline(transaction=False)
    pipe.set("marker", "state-first")
    with publishes_into(pipe):
        celery_app.send_task(
            TASK_CHAT, args=[{"rid": "r1", "attempt": 1}], task_id="r1.1", queue=queue
        )
    assert _queued(r, queue) == 0  # nothing sent yet
    assert r.get("marker") is None
    pipe.execute()
    assert r.get("marker") == b"state-first"
    assert _queued(r, queue) == 1

    # outside the block publishing is immediate again
    celery_app.send_task(TASK_CHAT, args=[{"rid": "r2", "attempt": 1}], task_id="r2.1", queue=queue)
    assert _queued(r, queue) == 2

    got = _take(celery_app, queue, 2)
    ids = sorted(h["id"] for h, _ in got)
    assert ids == ["r1.1", "r2.1"]
    assert all(h["task"] == TASK_CHAT for h, _ in got)
    assert sorted(body[0][0]["rid"] for _, body in got) == ["r1", "r2"]


def test_a_failed_pipeline_publishes_nothing(celery_app: Any, redis_server: Any) -> None:
    r = redis.Redis.from_url(redis_server.url)
    queue = "test-dc.batch"
    r.delete(queue)
    with pytest.raises(RuntimeError), r.pipeline(transaction=False) as pipe:
        with publishes_into(pipe):
            celery_app.send_task(TASK_CHAT, args=[{}], task_id="x.1", queue=queue)
        raise RuntimeError("routing failed after the publish was built")
    assert _queued(r, queue) == 0


def _wire(pipe: Any) -> list[dict[str, Any]]:
    """The messages a pipeline would LPUSH, without what differs per publish."""
    out = []
    for args, _options in pipe.command_stack:
        assert args[0] == "LPUSH"
        msg = json.loads(args[2])
        msg["properties"].pop("delivery_tag")
        out.append(msg)
    return out


def test_pipeline_publisher_writes_what_send_task_writes(
    celery_app: Any, redis_server: Any
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    queue = "test-dc.long_context"
    job = {"rid": "r9", "attempt": 2, "body": {"messages": [{"role": "user", "content": "hé"}]}}
    slow, fast = r.pipeline(transaction=False), r.pipeline(transaction=False)
    with publishes_into(slow):
        # the call the gateway made before it had the publisher
        celery_app.send_task(
            TASK_CHAT,
            args=[job],
            task_id="r9.2",
            queue=queue,
            routing_key=queue,
            argsrepr="",
            kwargsrepr="",
            headers={"prefill": 12},
        )
    publisher = PipelinePublisher(celery_app)
    for _ in range(2):  # the first publish declares the queue, the second does not
        publisher.publish(fast, TASK_CHAT, [job], "r9.2", queue, {"prefill": 12})
    want = _wire(slow)[0]
    # send_task also copies its argsrepr/kwargsrepr options into the message
    # properties, where nothing reads them (the headers carry them)
    for name in ("argsrepr", "kwargsrepr"):
        assert want["properties"].pop(name) == ""
    assert _wire(fast) == [want, want]
    assert want["headers"]["id"] == "r9.2" and want["headers"]["prefill"] == 12

    # nothing is sent before the caller's pipeline runs; then a worker can take both
    r.delete(queue)
    assert _queued(r, queue) == 0
    fast.execute()
    assert _queued(r, queue) == 2
    assert [body[0][0] for _, body in _take(celery_app, queue, 2)] == [job, job]


def test_pipeline_publisher_is_safe_across_threads(celery_app: Any, redis_server: Any) -> None:
    r = redis.Redis.from_url(redis_server.url)
    publisher = PipelinePublisher(celery_app)
    pipes = [r.pipeline(transaction=False) for _ in range(8)]

    def run(k: int) -> None:
        for i in range(25):
            publisher.publish(pipes[k], TASK_CHAT, [{"rid": f"{k}-{i}"}], f"{k}-{i}.1", f"q{k % 2}")

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, pipe in enumerate(pipes):
        msgs = _wire(pipe)
        assert [m["headers"]["id"] for m in msgs] == [f"{k}-{i}.1" for i in range(25)]
        assert {m["properties"]["delivery_info"]["routing_key"] for m in msgs} == {f"q{k % 2}"}
        pipe.reset()


# -- the API server ---------------------------------------------------------------------
@contextlib.contextmanager
def _serving(
    threads: int, linger_s: float = LINGER_S
) -> Iterator[tuple[ApiServer, threading.Event]]:
    """An ApiServer over a small app: ``/ping``, ``/who`` (the serving thread)
    and ``/stream``, whose second chunk waits for the yielded event."""
    app = Flask("t")
    release = threading.Event()

    @app.get("/ping")
    def ping() -> Any:
        return {"ok": True}

    @app.get("/who")
    def who() -> Any:
        return {"thread": threading.get_ident()}

    @app.get("/stream")
    def stream() -> Response:
        def gen() -> Iterator[bytes]:
            yield b"data: first\n\n"
            release.wait(20)  # the client must see the first chunk before this returns
            yield b"data: [DONE]\n\n"

        return Response(gen(), mimetype="text/event-stream")

    srv = ApiServer(app, threads=threads, linger_s=linger_s)
    srv.start_background()
    try:
        yield srv, release
    finally:
        release.set()
        srv.shutdown()


@pytest.fixture()
def server() -> Iterator[tuple[ApiServer, threading.Event]]:
    with _serving(threads=8) as served:
        yield served


def test_server_keeps_connections_alive(server: tuple[ApiServer, threading.Event]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server[0].port, timeout=5)
    conn.request("GET", "/ping")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b'{"ok":true}\n'
    assert not resp.will_close
    sock = conn.sock
    conn.request("GET", "/ping")
    assert conn.getresponse().read() == b'{"ok":true}\n'
    assert conn.sock is sock  # the same TCP connection served both


def test_server_streams_chunks_as_they_are_yielded(
    server: tuple[ApiServer, threading.Event],
) -> None:
    srv, release = server
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    conn.request("GET", "/stream")
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read1(65536) == b"data: first\n\n"  # before the generator may finish
    release.set()
    assert resp.read() == b"data: [DONE]\n\n"


def test_a_server_thread_keeps_serving_a_busy_connection() -> None:
    with _serving(threads=4, linger_s=30.0) as (srv, _):
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        seen = set()
        for _ in range(4):
            conn.request("GET", "/who")
            seen.add(json.loads(conn.getresponse().read())["thread"])
        assert len(seen) == 1, "the thread that served the request waits for the next one"


def test_a_lingering_thread_yields_to_waiting_connections() -> None:
    """Two threads: one lingers on an idle connection, the other streams. A
    third connection must still be served (the lingering thread hands its
    connection back when it sees one waiting), before the stream ends and
    long before the 30 s linger or the client's 10 s timeout."""
    with _serving(threads=2, linger_s=30.0) as (srv, release):
        idle = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        idle.request("GET", "/ping")
        assert idle.getresponse().read() == b'{"ok":true}\n'  # its thread now lingers
        streaming = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        streaming.request("GET", "/stream")
        resp = streaming.getresponse()
        assert resp.read1(65536) == b"data: first\n\n"  # the other thread is busy
        late = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        late.request("GET", "/ping")
        assert late.getresponse().read() == b'{"ok":true}\n'
        assert not release.is_set()
        release.set()
        assert resp.read() == b"data: [DONE]\n\n"
        idle.request("GET", "/ping")  # the handed-back connection still works
        assert idle.getresponse().status == 200


# -- the load generators' client ---------------------------------------------------------
class _DropIdle:
    """A one-response-per-connection HTTP/1.1 server that claims keep-alive but
    closes each connection once the response is out: every reuse finds a dead socket."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = c.recv(65536)
                if not chunk:
                    break
                data += chunk
            if data:
                self.requests += 1
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            time.sleep(0.05)
            c.close()


def test_keepalive_client_retries_a_stale_connection_once() -> None:
    srv = _DropIdle()
    client = KeepAliveClient(f"http://127.0.0.1:{srv.port}", timeout_s=5)
    for _ in range(3):
        resp = client.request("GET", "/")
        assert resp.status == 200 and resp.read() == b"ok"
        time.sleep(0.1)  # the server has closed the connection by now
    assert srv.requests == 3  # each request reached the server exactly once


def test_keepalive_client_does_not_retry_a_fresh_connection() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    client = KeepAliveClient(f"http://127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(ConnectionRefusedError):
        client.request("GET", "/")


# -- late-ack bookkeeping on receive ---------------------------------------------------
def _consume(app: Any, queue: str, on_message: Any, want: int) -> None:
    from kombu import Queue

    seen = [0]

    def cb(body: Any, msg: Any) -> None:
        seen[0] += 1
        on_message(body, msg)

    with (
        app.connection_for_read() as conn,
        conn.Consumer(Queue(queue, routing_key=queue), accept=["json"], callbacks=[cb]),
    ):
        deadline = time.monotonic() + 5
        while seen[0] < want and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
    assert seen[0] >= want


def _unacked(r: redis.Redis) -> int:
    return int(r.hlen("unacked"))


def test_unacked_copy_is_kept_until_the_ack(celery_app: Any, redis_server: Any) -> None:
    """A message handed off but not acknowledged keeps its Redis copy (the
    visibility-timeout restore needs it); acknowledging from another thread,
    as Celery's pool does, removes it."""
    r = redis.Redis.from_url(redis_server.url)
    queue = "test-qos.interactive"
    r.delete(queue, "unacked", "unacked_index")
    celery_app.send_task(TASK_CHAT, args=[{}], task_id="k1.1", queue=queue)
    held: list[Any] = []
    from kombu import Queue

    with (
        celery_app.connection_for_read() as conn,
        conn.Consumer(
            Queue(queue, routing_key=queue),
            accept=["json"],
            callbacks=[lambda body, msg: held.append(msg)],
        ),
    ):
        deadline = time.monotonic() + 5
        while not held and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
        assert held and _unacked(r) == 1
        t0 = time.monotonic()
        acker = threading.Thread(target=held[0].ack)
        acker.start()
        acker.join(5)
        assert time.monotonic() - t0 < 2.0
        assert _unacked(r) == 0
        assert int(r.zcard("unacked_index")) == 0


def test_ack_inside_the_callback_leaves_no_copy(celery_app: Any, redis_server: Any) -> None:
    r = redis.Redis.from_url(redis_server.url)
    queue = "test-qos.batch"
    r.delete(queue, "unacked", "unacked_index")
    for i in range(3):
        celery_app.send_task(TASK_CHAT, args=[{}], task_id=f"a{i}.1", queue=queue)
    t0 = time.monotonic()
    _consume(celery_app, queue, lambda body, msg: msg.ack(), want=3)
    assert time.monotonic() - t0 < 3.0  # no ack waited on its own hand-off
    assert _unacked(r) == 0 and int(r.zcard("unacked_index")) == 0


def test_requeue_inside_the_callback_puts_the_message_back(
    celery_app: Any, redis_server: Any
) -> None:
    r = redis.Redis.from_url(redis_server.url)
    queue = "test-qos.long_context"
    r.delete(queue, "unacked", "unacked_index")
    celery_app.send_task(TASK_CHAT, args=[{"rid": "q"}], task_id="q.1", queue=queue)
    _consume(celery_app, queue, lambda body, msg: msg.requeue(), want=1)
    assert _queued(r, queue) == 1  # back in its queue, not lost
    assert _unacked(r) == 0


# ---- command packing (tokenfleet.live.redis_pack) ---------------------------------
_PACK_CASES: list[tuple[Any, ...]] = [
    ("HINCRBY", "tf:acct:i0", "prefill_tokens", -8192),
    ("HSET", "tf:req:x", "created", 1733450000.123456, "queue", "q", "attempt", 1),
    ("SET", "tf:lease:x", "api:1", "PX", 30000),
    ("XADD", b"tf:kv", "MAXLEN", "~", 200000, "*", "h", b"\x00\xff\r\n"),
    ("PUBLISH", "tf:gate:i0", 0.1),
    ("CLIENT SETNAME", "tokenfleet-api"),
    ("SET", "k", "é ü", "EX", 2**40),
    ("SET", "k", 1e-05),
    ("SET", "k", memoryview(b"view")),
    ("SET", "k", bytearray(b"array")),
]


@pytest.mark.parametrize("args", _PACK_CASES, ids=[str(c[0]) for c in _PACK_CASES])
def test_hiredis_packing_writes_redis_pys_bytes(args: tuple[Any, ...]) -> None:
    from tokenfleet.live.redis_pack import HiredisPacker

    conn = redis.Connection()
    theirs = b"".join(conn._command_packer.pack(*args))
    ours = b"".join(HiredisPacker(conn._command_packer).pack(*args))
    assert ours == theirs


def test_hiredis_packing_refuses_what_redis_py_refuses() -> None:
    from tokenfleet.live.redis_pack import HiredisPacker

    packer = HiredisPacker(redis.Connection()._command_packer)
    for bad in (True, None):
        with pytest.raises(redis.DataError):
            packer.pack("SET", "k", bad)


def test_live_state_connections_pack_with_hiredis(redis_server: Any) -> None:
    """The live state's pool (and the pools copied from it) pack with hiredis;
    values written through it read back as redis-py wrote them."""
    from tokenfleet.live.redis_pack import HiredisPacker
    from tokenfleet.live.state import LiveState

    state = LiveState.from_url(redis_server.url, prefix="pack-test")
    try:
        now = time.time()
        with state.r.pipeline(transaction=False) as pipe:
            pipe.hset("pack-test:h", mapping={"created": now, "n": 3, "s": "ü"})
            pipe.hincrby("pack-test:h", "n", 2)
            pipe.execute()
        got = state.r.hgetall("pack-test:h")
        assert got == {b"created": repr(now).encode(), b"n": b"5", b"s": "ü".encode()}
        conn = state.r.connection_pool.get_connection()
        try:
            assert isinstance(conn._command_packer, HiredisPacker)
        finally:
            state.r.connection_pool.release(conn)
    finally:
        state.r.delete("pack-test:h")
        state.r.close()
