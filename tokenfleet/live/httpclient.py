"""A keep-alive HTTP client for the load generators (``tokenfleet bench``, overhead).

One ``http.client`` connection per sender thread. A server may close an idle
keep-alive connection just as a request is written to it; the request then
fails with a reset or an empty reply although the server never read it. Like
browsers and Go's ``net/http``, we retry such a request once on a fresh
connection, but only when the connection was reused and no response byte
came back, so a request the server did see is never sent twice.
"""

from __future__ import annotations

import http.client
import threading
from urllib.parse import urlsplit

#: what a stale keep-alive connection looks like when written to
_STALE = (
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
    http.client.RemoteDisconnected,
)


class KeepAliveClient:
    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.path = u.path.rstrip("/")
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _conn(self) -> tuple[http.client.HTTPConnection, bool]:
        c = getattr(self._local, "conn", None)
        if c is not None:
            return c, c.sock is not None  # http.client reconnects a closed one itself
        c = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        self._local.conn = c
        return c, False

    def drop(self) -> None:
        """Close this thread's connection (after an error mid-response)."""
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
        self._local.conn = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> http.client.HTTPResponse:
        """Send and return the response with its status read; the caller reads
        the body, and calls :meth:`drop` if it gives up on it midway."""
        for attempt in (0, 1):
            conn, reused = self._conn()
            try:
                conn.request(method, self.path + path, body=body, headers=headers or {})
                return conn.getresponse()
            except _STALE:
                self.drop()
                if not reused or attempt:
                    raise
            except BaseException:
                self.drop()
                raise
        raise AssertionError("unreachable")
