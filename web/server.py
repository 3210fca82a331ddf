"""The HTTP server of the API: cheroot, a thread pool with keep-alive.

Why not werkzeug's development server: it answers every request with
``Connection: close`` (its handler cannot drain a request body safely before
the next request line), so each request pays a TCP handshake and a new
thread, and every per-thread cache (Celery's producer and backend, redis-py
connections) starts cold. Measured on the live path at 50 req/s
(``python benchmarks/live_overhead.py``): time to first token through the API
fell by about 1.5 ms with cheroot (docs/live.md). Why not waitress: it
writes responses from its I/O thread, one more hand-off per streamed chunk,
which cost more than keep-alive saved (docs/live.md).

Cheroot (CherryPy's server) keeps idle connections in a selector and hands a
connection to a pool thread when a request arrives; that thread runs the
WSGI app and writes each yielded chunk straight to the socket, so SSE chunks
leave as they are produced. A request in flight (a stream included) holds
one pool thread: ``threads`` bounds concurrent requests, and more wait in
the accept queue rather than fail.

**A thread stays with a busy connection.** After a keep-alive request,
cheroot hands the connection back to its selector thread, which, when the
next request arrives, queues it for a pool thread: two thread wake-ups
before the request is read. While at least a quarter of the pool is idle,
the thread that served a request instead waits on that connection for up to
``linger_s`` and serves the next request itself, the way a thread-per-
connection server (the stdlib's, which the engine emulator uses) does. It
gives the connection back when the linger ends, when the pool runs short of
idle threads, or when connections are waiting in the queue. Measured with a
trivial streaming Flask route (``benchmarks/api_ingress.py``, 50
requests/s on one connection): time to first chunk p50 lower in 10 of 13
alternated pairs of runs, by 0.12 ms at the median (1.21-1.49 ms without);
docs/benchmarks.md.

**The pool grows with the connections** (up to ``max_threads``). A stream
holds its thread while it waits (its tokens come from the process's one relay
reader, :class:`tokenfleet.live.relay.RelayHub`, not from a Redis connection
of its own), so the number of streams a process holds is a thread count, not
a queue: with the former fixed pool of 128, the 129th request waited unseen in
the accept queue, and so did ``/health``. Now a connection that finds no idle
thread gets a new one; the chat view refuses, with a 503 at once, what is
over the process's in-flight bound (``LiveConfig.api_max_inflight``), and the
pool's ceiling is that bound plus a reserve, so ``/health`` and ``/metrics``
always find a thread. Threads above the base count that stay idle are retired.

**``/health`` does not need a pool thread.** The selector thread answers a
bare ``GET /health`` itself from the app's copy of the instances (no I/O:
:data:`InlineAnswer`), and a new connection waits in the selector until its
client has sent something, so neither a probe nor a silent client waits for
a thread (docs/live.md, "Holding 2,000 streams", 9).

:func:`client_gone` tells a waiting request whether its client closed the
connection (EOF on the socket), so a non-streamed request, which writes
nothing until its answer, is cancelled as a stream would be.
"""

from __future__ import annotations

import io
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from cheroot.workers.threadpool import WorkerThread
from cheroot.wsgi import Gateway_10
from cheroot.wsgi import Server as _CherootServer

from tokenfleet.live import steps
from tokenfleet.live.gateway.pump import PumpSink

log = logging.getLogger("tokenfleet.api")

#: seconds an idle keep-alive connection is kept; above the usual 60 s idle
#: timeout of load balancers, so the balancer, not us, closes idle connections
KEEPALIVE_S = 65

#: largest request line + headers cheroot reads (its default is no limit, so a
#: client could make it buffer any amount); real requests use a few KiB
MAX_HEADER_BYTES = 64 * 1024

#: seconds a pool thread waits on the connection it just served for the next
#: request before handing it back to the selector (0 disables); the live
#: service takes it from ``LiveConfig.api_linger_s``
LINGER_S = 1.0
#: how often a lingering thread looks at the pool (queued connections, stop)
_LINGER_STEP_S = 0.05
#: threads above the ceiling of chat requests: /health, /metrics, /v1/models
RESERVE_THREADS = 64
#: threads added at once when a connection finds none idle
_GROW_STEP = 16
#: threads above the base count idle this long are retired
_RETIRE_IDLE_S = 30.0
#: the WSGI environ key of the request's connection (see :func:`client_gone`)
CONN_KEY = "tokenfleet.conn"
#: the WSGI environ key of cheroot's request (see :func:`pump_sink`)
REQ_KEY = "tokenfleet.req"


def pump_sink(environ: Mapping[str, Any], frame: Callable[[str], bytes] | None) -> PumpSink | None:
    """Where the stream pump may write this request's tokens (``frame`` set: a
    streamed answer), or collect them (None: one JSON answer): the
    connection's plain socket. None under another server, or TLS."""
    conn = environ.get(CONN_KEY)
    req = environ.get(REQ_KEY)
    sock = getattr(conn, "socket", None)
    if req is None or not (isinstance(sock, socket.socket) and type(sock) is socket.socket):
        return None
    return PumpSink(
        sock,
        frame,
        # a streamed answer's body goes after its head; a whole one is collected
        ready=lambda: frame is None or bool(req.sent_headers),
        chunked=lambda: bool(req.chunked_write),
    )


#: the WSGI environ key of the status a deferred response ended with
#: (:func:`response_restarter`), for the access log
STATUS_KEY = "tokenfleet.status"

#: (status, headers) -> whether the response's head was replaced
Restart = Callable[[int, Mapping[str, str]], bool]


def response_restarter(environ: dict[str, Any]) -> Restart | None:
    """A way to replace a response's status and headers until its first body
    bytes are written, or None under another server.

    WSGI sends a response's head with its first non-empty body chunk, so a
    streamed answer can be returned before its first token and set up
    (Flask's response handling, werkzeug's headers, the server's
    ``start_response``) while the engine prefills; if what comes first is an
    error, the view replaces the head it returned. PEP 3333 has
    ``start_response(..., exc_info)`` for that, but Flask does not hand it to
    a response body, and cheroot's appends headers instead of replacing them,
    so this sets cheroot's request directly (``status``, ``outheaders``)."""
    req = environ.get(REQ_KEY)
    if req is None or not hasattr(req, "outheaders"):
        return None

    def restart(status: int, headers: Mapping[str, str]) -> bool:
        if req.sent_headers:
            return False
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Client Closed Request" if status == 499 else "Error"
        req.status = f"{status} {phrase}".encode("ISO-8859-1")
        req.outheaders = [
            (k.encode("ISO-8859-1"), str(v).encode("ISO-8859-1")) for k, v in headers.items()
        ]
        environ[STATUS_KEY] = status
        return True

    return restart


def client_gone(environ: Mapping[str, Any]) -> Callable[[], bool] | None:
    """A check that says whether the client of this request closed its
    connection: the socket is readable and reading would return EOF (or it
    reports a hang-up). Pipelined bytes of a next request are not EOF. None
    when the server does not expose the connection (another WSGI server)."""
    conn = environ.get(CONN_KEY)
    sock = getattr(conn, "socket", None)
    if sock is None:
        return None
    try:
        fd = sock.fileno()
    except OSError:
        return lambda: True
    poller = select.poll()
    rdhup = getattr(select, "POLLRDHUP", 0)
    poller.register(fd, select.POLLIN | select.POLLPRI | rdhup)
    plain = isinstance(sock, socket.socket) and type(sock) is socket.socket

    polling = threading.Lock()

    def gone() -> bool:
        # asked by the request's thread and by the direct calls' watch thread
        # (tokenfleet/live/gateway/direct.py); a poll object refuses two at once
        if not polling.acquire(blocking=False):
            return False  # the other is asking right now
        try:
            events = poller.poll(0)
        except OSError:
            return True
        finally:
            polling.release()
        for _fd, ev in events:
            if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL | rdhup):
                return True
            if ev & select.POLLIN and plain:
                try:
                    return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"")
                except BlockingIOError:
                    return False
                except OSError:
                    return True
        return False

    return gone


class _OneWriteGateway(Gateway_10):
    """Sends the response headers and the first body chunk in one write.

    Cheroot writes them separately; the first write wakes the client, which
    then waits for the second: for a stream, the first token. One write means
    one wake-up and one system call fewer on the time-to-first-token path.
    It also puts the connection in the environ (:data:`CONN_KEY`)."""

    def get_environ(self) -> Any:
        env: dict[str, Any] = super().get_environ()  # type: ignore[no-untyped-call]
        env[CONN_KEY] = self.req.conn
        env[REQ_KEY] = self.req
        return env

    def write(self, chunk: bytes) -> None:
        req = self.req
        if req.sent_headers or not chunk:
            super().write(chunk)
            return
        conn = req.conn
        real = conn.wfile
        held = io.BytesIO()
        conn.wfile = held
        try:
            super().write(chunk)  # status line, headers and the framed chunk
        finally:
            conn.wfile = real
        real.write(held.getvalue())


#: ``/health`` answered by the server itself: () -> (status, JSON body,
#: headers), or None to leave the request to the app; it must not do I/O
InlineAnswer = Callable[[], tuple[int, bytes, dict[str, str]] | None]
_HEALTH_LINES = (b"GET /health HTTP/1.1", b"GET /health HTTP/1.0")
_PEEK_BYTES = 4096
_POOL, _WAIT, _DONE = 0, 1, 2  # what to do with a ready connection (_inline)


class _LingeringServer(_CherootServer):
    """cheroot's WSGI server whose pool threads linger on a busy connection,
    whose pool grows when a connection finds no idle thread, and which answers
    ``/health`` on its selector thread when it can (:meth:`_inline`)."""

    linger_s = LINGER_S
    inline_health: InlineAnswer | None = None
    _last_retire = 0.0
    _idle_since = 0.0
    _grower: threading.Thread | None = None
    _grow_kick: threading.Event | None = None

    def process_conn(self, conn: Any) -> None:
        if self.inline_health is not None:
            verdict = self._inline(conn)
            if verdict == _DONE:
                return
            if verdict == _WAIT:  # nothing sent yet: wait in the selector, not a thread
                _CherootServer.put_conn(self, conn)
                return
        # runs on the selector thread: never wait here. Starting a thread waits
        # until it runs (``Thread.start``), which on a loaded machine took long
        # enough for 16 of them to hold up every connection behind, /health
        # probes included: the grower thread starts them instead.
        pool = self.requests
        try:
            idle = pool.idle
            if idle <= pool.qsize and len(pool._threads) < pool.max:
                self._want_threads()
            self._maybe_retire(pool, idle)
        except Exception:  # serve with the threads there are
            log.exception("could not grow the server's thread pool")
        super().process_conn(conn)

    def _inline(self, conn: Any) -> int:
        """Answer a ``GET /health`` here, on the selector thread, from what the
        app knows without I/O (:data:`InlineAnswer`).

        Why: holding thousands of streams, a probe handed to a pool thread
        waited for that thread's turns at the interpreter behind every
        stream's thread, several times per request (the hand-off, each read,
        the app, each write), and a probe past 100 ms read as a sick process
        (docs/live.md, "Holding 2,000 streams"). Here it costs a peek, a read
        and a write. Anything else, or a request the peek cannot see whole,
        goes to the pool as before (:data:`_POOL`); a new connection that has
        sent nothing yet waits in the selector (:data:`_WAIT`) rather than in a
        pool thread, so an idle client holds no thread either."""
        sock = conn.socket
        if type(sock) is not socket.socket or conn.rfile.has_data():
            return _POOL  # TLS, or cheroot already buffered the next request
        # a socket with a timeout waits for readiness before every call, flags or
        # not: the selector thread must never wait, so no timeout while here
        timeout_s = sock.gettimeout()
        sock.settimeout(0.0)
        try:
            return self._inline_nowait(conn, sock)
        finally:
            if sock.fileno() >= 0:
                sock.settimeout(timeout_s)

    def _inline_nowait(self, conn: Any, sock: socket.socket) -> int:
        try:
            head = sock.recv(_PEEK_BYTES, socket.MSG_PEEK)
        except BlockingIOError:
            return _WAIT
        except OSError:
            return _POOL  # cheroot's own read reports it
        end = head.find(b"\r\n\r\n")
        line = head[: head.find(b"\r\n")]
        if end < 0 or line not in _HEALTH_LINES:
            return _POOL
        fields = {}
        for raw in head[:end].split(b"\r\n")[1:]:
            name, _, value = raw.partition(b":")
            fields[name.strip().lower()] = value.strip().lower()
        if fields.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in fields:
            return _POOL  # a body on a GET: let the full parser judge it
        assert self.inline_health is not None
        try:
            answer = self.inline_health()
        except Exception:  # the app's route answers (and logs) instead
            log.debug("inline /health failed", exc_info=True)
            return _POOL
        if answer is None:
            return _POOL
        status, body, headers = answer
        keep = line.endswith(b"1.1") and fields.get(b"connection") != b"close"
        lines = [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        if not keep:
            lines.append("Connection: close")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        try:
            sock.recv(end + 4)  # the request, peeked above
            sent = sock.send(data)
        except OSError:
            sent = -1
        if sent != len(data) or not keep:  # never wait for a client that does not read
            conn.close()
        else:
            _CherootServer.put_conn(self, conn)
        return _DONE

    def _want_threads(self) -> None:
        if self._grower is None:
            self._grow_kick = threading.Event()
            self._grower = threading.Thread(target=self._grow_loop, name="api-grow", daemon=True)
            self._grower.start()
        assert self._grow_kick is not None
        self._grow_kick.set()

    def _grow_loop(self) -> None:
        """Add threads, :data:`_GROW_STEP` at a time, while connections find none idle."""
        kick = self._grow_kick
        assert kick is not None
        while True:
            kick.wait()
            kick.clear()
            pool = self.requests
            try:
                while self.ready and pool.idle <= pool.qsize and len(pool._threads) < pool.max:
                    for _ in range(min(_GROW_STEP, int(pool.max - len(pool._threads)))):
                        worker = WorkerThread(self)  # type: ignore[no-untyped-call]
                        worker.name = f"CP Server {worker.name!s}"
                        worker.start()
                        pool._threads.append(worker)
            except Exception:  # serve with the threads there are
                log.exception("could not grow the server's thread pool")

    def _maybe_retire(self, pool: Any, idle: int) -> None:
        """Retire threads above the base count that have been idle a while."""
        now = time.monotonic()
        extra = len(pool._threads) - pool.min
        if extra <= 0 or idle < 2 * _GROW_STEP:
            self._idle_since = 0.0
            return
        if not self._idle_since:
            self._idle_since = now
        if now - self._idle_since < _RETIRE_IDLE_S or now - self._last_retire < _RETIRE_IDLE_S:
            return
        self._last_retire = now
        pool.shrink(min(extra, idle - _GROW_STEP))

    def _may_linger(self) -> bool:
        pool = self.requests
        return self.ready and pool.qsize == 0 and pool.idle * 4 >= max(1, len(pool._threads))

    def put_conn(self, conn: Any) -> None:
        # runs on the pool thread, in cheroot's ``finally``: nothing may escape
        try:
            waited = 0.0
            poller = None
            while self.linger_s > 0 and waited < self.linger_s and self._may_linger():
                if poller is None:  # poll, not select: no limit on the descriptor
                    poller = select.poll()
                    poller.register(conn.socket.fileno(), select.POLLIN)
                if conn.rfile.has_data():
                    ready = True
                else:
                    ready = bool(poller.poll(_LINGER_STEP_S * 1000))
                if not ready:
                    waited += _LINGER_STEP_S
                    continue
                waited = 0.0
                if not conn.communicate():
                    conn.close()
                    return
            if not self.ready:  # stopping: the selector may be closed already
                conn.close()
                return
            super().put_conn(conn)
        except Exception:
            log.debug("lingering connection dropped", exc_info=True)
            conn.close()


class ApiServer:
    """``serve_forever()`` in one thread, ``shutdown()`` from another."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        threads: int = 128,
        linger_s: float = LINGER_S,
        max_threads: int | None = None,
        inline_health: InlineAnswer | None = None,
    ) -> None:
        """``threads`` start and stay; the pool grows to ``max_threads``
        (default: the app's ``api_max_inflight`` plus :data:`RESERVE_THREADS`).
        ``inline_health`` (default: the app's ``tokenfleet.inline_health``
        extension, if any) answers ``/health`` without a pool thread."""
        if max_threads is None:
            live = getattr(app, "extensions", {}).get("tokenfleet")
            bound = getattr(getattr(live, "live", None), "api_max_inflight", 0) or 4096
            max_threads = bound + RESERVE_THREADS
        self._server = _LingeringServer(
            (host, port),
            steps.wrap_app(app),
            numthreads=max(1, threads),
            max=max(threads, max_threads),
            request_queue_size=1024,
            timeout=KEEPALIVE_S,
            shutdown_timeout=2,
        )
        self._server.linger_s = linger_s
        if inline_health is None:
            inline_health = getattr(app, "extensions", {}).get("tokenfleet.inline_health")
        self._server.inline_health = inline_health
        self._server.max_request_header_size = MAX_HEADER_BYTES  # 413 beyond
        self._server.gateway = _OneWriteGateway
        # bind now, so a taken port fails here and port 0 resolves at once
        self._server.prepare()
        self.host = host
        self.port = int(self._server.bind_addr[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve_forever(self) -> None:
        self._server.serve()

    def shutdown(self) -> None:
        self._server.stop()

    def start_background(self, name: str = "api") -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        t.start()
        return t
