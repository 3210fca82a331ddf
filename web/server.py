"""The HTTP server of the API: cheroot, a thread pool with keep-alive.

Why not werkzeug's development server: it answers every request with
``Connection: close`` (its handler cannot drain a request body safely before
the next request line), so each request pays a TCP handshake and a new
thread, and every per-thread cache (Celery's producer and backend, redis-py
connections) starts cold. Measured on the live path at 50 req/s
(``python -m tokenfleet.live.overhead``): time to first token through the API
fell by about 1.5 ms with cheroot (docs/live.md). Why not waitress: it
writes responses from its I/O thread, one more hand-off per streamed chunk,
which cost more than keep-alive saved (docs/live.md).

Cheroot (CherryPy's server) keeps idle connections in a selector and hands a
connection to a pool thread when a request arrives; that thread runs the
WSGI app and writes each yielded chunk straight to the socket, so SSE chunks
leave as they are produced. A request in flight (a stream included) holds
one pool thread: ``threads`` bounds concurrent requests, and more wait in
the accept queue rather than fail.
"""

from __future__ import annotations

import io
import threading
from typing import Any

from cheroot.wsgi import Gateway_10

#: seconds an idle keep-alive connection is kept; above the usual 60 s idle
#: timeout of load balancers, so the balancer, not us, closes idle connections
KEEPALIVE_S = 65


class _OneWriteGateway(Gateway_10):
    """Sends the response headers and the first body chunk in one write.

    Cheroot writes them separately; the first write wakes the client, which
    then waits for the second: for a stream, the first token. One write means
    one wake-up and one system call fewer on the time-to-first-token path."""

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


class ApiServer:
    """``serve_forever()`` in one thread, ``shutdown()`` from another."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 threads: int = 128) -> None:
        from cheroot.wsgi import Server

        self._server = Server((host, port), app, numthreads=max(1, threads),
                              request_queue_size=256, timeout=KEEPALIVE_S,
                              shutdown_timeout=2)
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
