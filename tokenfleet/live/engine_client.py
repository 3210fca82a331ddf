"""HTTP client for one engine's OpenAI-compatible streaming API.

Uses ``http.client`` directly: one keep-alive connection per worker thread,
no per-request session set-up, and a socket another thread can shut down to
abort the call at once. Closing the connection is how vLLM learns that a
client went away (it aborts the request on ``http.disconnect``); the emulator
polls for it every 50 ms. ``POST /abort_request`` (SGLang style, which the
emulator also serves) is sent as well, best effort.

Streams are read with ``read1``: it returns what the engine flushed, so one
read is one engine step's chunk (several SSE events), which the worker then
relays as one Redis entry.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class EngineError(Exception):
    """The engine failed the request; ``retryable`` if another instance may succeed."""

    def __init__(
        self,
        message: str,
        status: int = 502,
        retryable: bool = True,
        started: bool = False,
        kind: str = "error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.started = started  # tokens were already produced
        self.kind = kind  # "error" | "stall" | "connect" | "aborted" | "client"


@dataclass(slots=True)
class StreamPiece:
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


_local = threading.local()


class EngineCall:
    """One streaming chat completion against one engine."""

    def __init__(
        self,
        base_url: str,
        body: dict[str, Any],
        request_id: str,
        *,
        connect_timeout_s: float = 2.0,
        stall_timeout_s: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        u = urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.base_url = base_url
        self.body = body
        self.request_id = request_id
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.headers = headers or {}
        self._conn: http.client.HTTPConnection | None = None
        self._resp: http.client.HTTPResponse | None = None
        self._aborted: str | None = None
        self._lock = threading.Lock()
        self._reusable = False

    # -- connection pool of one per thread -------------------------------------------
    def _take_conn(self) -> http.client.HTTPConnection:
        pool: dict[tuple[str, int], http.client.HTTPConnection] = getattr(_local, "pool", {})
        _local.pool = pool
        conn = pool.pop((self.host, self.port), None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout_s)
        return conn

    def _give_back(self) -> None:
        if self._conn is None:
            return
        if self._reusable and self._aborted is None:
            _local.pool[(self.host, self.port)] = self._conn
        else:
            self._conn.close()
        self._conn = None

    # -- the call ------------------------------------------------------------------
    def _send(self) -> http.client.HTTPResponse:
        payload = json.dumps(self.body).encode()
        hdrs = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "X-Request-Id": self.request_id,
            **self.headers,
        }
        # a legacy completion (``prompt``, /v1/completions) goes to the engine's own
        path = "/v1/completions" if "prompt" in self.body else "/v1/chat/completions"
        for attempt in range(2):  # a pooled keep-alive connection may have gone stale
            conn = self._take_conn()
            fresh = conn.sock is None
            with self._lock:
                self._conn = conn
                if self._aborted:
                    raise EngineError(f"aborted: {self._aborted}", 499, False, kind="aborted")
            try:
                conn.request("POST", path, body=payload, headers=hdrs)
                if conn.sock is not None:
                    conn.sock.settimeout(self.stall_timeout_s)
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn.getresponse()
            except (
                ConnectionError,
                http.client.RemoteDisconnected,
                http.client.BadStatusLine,
            ) as exc:
                conn.close()
                self._conn = None
                if self._aborted:
                    raise EngineError(
                        f"aborted: {self._aborted}", 499, False, kind="aborted"
                    ) from None
                if fresh or attempt:
                    raise EngineError(
                        f"engine {self.base_url} unreachable: {exc!r}", 503, kind="connect"
                    ) from None
            except TimeoutError:
                conn.close()
                self._conn = None
                raise EngineError(
                    f"engine {self.base_url} did not answer within {self.stall_timeout_s:.1f}s",
                    504,
                    kind="stall",
                ) from None
            except OSError as exc:
                conn.close()
                self._conn = None
                if self._aborted:
                    raise EngineError(
                        f"aborted: {self._aborted}", 499, False, kind="aborted"
                    ) from None
                raise EngineError(
                    f"engine {self.base_url} unreachable: {exc!r}", 503, kind="connect"
                ) from None
        raise AssertionError("unreachable")

    def stream(self) -> Iterator[StreamPiece]:
        """Pieces of the completion, one per engine flush; raises EngineError."""
        resp = self._send()
        self._resp = resp
        started = False
        try:
            if resp.status != 200:
                raw = resp.read()
                self._reusable = not resp.will_close
                msg = _error_message(raw) or f"HTTP {resp.status}"
                # 4xx: the request itself is bad (another engine says the same).
                retryable = resp.status >= 500 or resp.status == 429
                raise EngineError(
                    f"engine answered {resp.status}: {msg}",
                    resp.status,
                    retryable,
                    kind="error" if retryable else "client",
                )
            buf = b""
            while True:
                try:
                    data = resp.read1(65536)
                except TimeoutError:
                    raise EngineError(
                        f"engine {self.base_url} produced nothing for {self.stall_timeout_s:.1f}s",
                        504,
                        True,
                        started,
                        kind="stall",
                    ) from None
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    if self._aborted:
                        raise EngineError(
                            f"aborted: {self._aborted}", 499, False, started, kind="aborted"
                        ) from None
                    raise EngineError(
                        f"engine stream broke: {exc!r}", 502, True, started, kind="error"
                    ) from None
                if not data:
                    if self._aborted:
                        raise EngineError(
                            f"aborted: {self._aborted}", 499, False, started, kind="aborted"
                        )
                    self._reusable = not resp.will_close
                    if buf.strip():
                        piece = _parse_events(buf)
                        if piece is not None:
                            yield piece
                    return
                buf += data
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                block, buf = buf[: cut + 2], buf[cut + 2 :]
                piece = _parse_events(block)
                if piece is None:
                    continue
                if piece.tokens:
                    started = True
                yield piece
        finally:
            self._give_back()

    def abort(self, reason: str) -> None:
        """Thread-safe: close the socket under the reader (the engine aborts)."""
        with self._lock:
            self._aborted = reason
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def aborted(self) -> str | None:
        return self._aborted


def send_abort(base_url: str, request_id: str, timeout_s: float = 1.0) -> None:
    """Best-effort ``POST /abort_request`` (SGLang/emulator); errors ignored."""
    u = urlsplit(base_url)
    try:
        conn = http.client.HTTPConnection(
            u.hostname or "127.0.0.1", u.port or 80, timeout=timeout_s
        )
        conn.request(
            "POST",
            "/abort_request",
            body=json.dumps({"rid": request_id}),
            headers={"Content-Type": "application/json"},
        )
        conn.getresponse().read()
        conn.close()
    except (OSError, http.client.HTTPException):
        pass


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message", ""))[:500]
        return str(err)[:500]
    return ""


def _parse_events(block: bytes) -> StreamPiece | None:
    """Merge the SSE events of one flush into one piece."""
    piece = StreamPiece()
    seen = False
    for line in block.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            ev = json.loads(data)
        except ValueError:
            continue
        if not isinstance(ev, dict):
            continue
        if "error" in ev:
            err = ev["error"]
            msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            raise EngineError(f"engine stream error: {msg}", 502, True, started=bool(piece.tokens))
        seen = True
        if ev.get("usage"):
            piece.usage = ev["usage"]
        for ch in ev.get("choices") or ():
            delta = ch.get("delta") or {}
            text = delta.get("content")
            if text is None:
                text = ch.get("text")
            if text:
                piece.text += text
                piece.tokens += 1
            if ch.get("finish_reason"):
                piece.finish_reason = ch["finish_reason"]
    return piece if seen else None
