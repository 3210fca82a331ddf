"""HTTP client for one engine's OpenAI-compatible streaming API.

Uses ``http.client`` directly: keep-alive connections shared by the process's
threads, no per-request session set-up, and a socket another thread can shut down to
abort the call at once. Closing the connection is how vLLM learns that a
client went away (it aborts the request on ``http.disconnect``); the emulator
polls for it every 50 ms. ``POST /abort_request`` (SGLang style, which the
emulator also serves) is sent as well, best effort.

Streams are read as they come: one read returns what the engine flushed since
the last (a chunked body is decoded here, not by ``http.client``, whose
``read1`` returns one chunk, one engine step, per call), merged into one piece.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tokenfleet.engine.profiles import EngineProfile


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


#: what a P/D router sends the prefill instance (vLLM's NixlConnector protocol):
#: keep the KV for a decode instance to pull
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: idle keep-alive connections per engine (host, port), shared by the process's
#: threads: the API serves a request on any of its many server threads, and a
#: pool per thread opened a new connection (and an engine-side thread) for most
_idle: dict[tuple[str, int], list[http.client.HTTPConnection]] = {}
_idle_lock = threading.Lock()
#: idle connections kept per engine; more are closed
MAX_IDLE_PER_ENGINE = 64


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
        prefill_url: str = "",
        first_token_timeout_s: float = 0.0,
    ) -> None:
        u = urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.base_url = base_url
        self.body = body
        self.request_id = request_id
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        #: the socket's timeout until the first token: a long prompt's prefill
        #: sends nothing for longer than a stall (:func:`first_token_timeout_s`)
        self.first_token_timeout_s = max(stall_timeout_s, first_token_timeout_s)
        self._timeout_s = self.first_token_timeout_s
        self.headers = headers or {}
        self._conn: http.client.HTTPConnection | None = None
        self._resp: http.client.HTTPResponse | None = None
        self._aborted: str | None = None
        self._lock = threading.Lock()
        self._reusable = False
        #: the body's decoding state once the stream has begun
        self.decoder: StreamDecoder | None = None
        self._detached = False  # another reader has the socket (detach)
        #: disaggregated: the instance that prefills first (:meth:`_remote_prefill`)
        self.prefill_url = prefill_url
        self._prefill: EngineCall | None = None
        #: the connection the request was sent on ahead of the read (:meth:`start`)
        self._started: http.client.HTTPConnection | None = None
        self._fresh = False  # the connection in use was opened for this call

    # -- the process's keep-alive connections ---------------------------------------
    def _take_conn(self, reuse: bool = True) -> http.client.HTTPConnection:
        """An idle connection to this engine, or a new one. ``reuse`` False (a
        pooled one just failed): the engine's other idle ones are likely stale
        too (it restarted, or closed them), so they are dropped."""
        with _idle_lock:
            idle = _idle.get((self.host, self.port))
            if not reuse:
                stale, idle = idle or [], None
                _idle.pop((self.host, self.port), None)
            conn = idle.pop() if idle else None  # the most recently used: likeliest alive
        if not reuse:
            for old in stale:
                old.close()
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout_s)
        return conn

    def _give_back(self) -> None:
        if self._detached:
            return  # the reader it was handed to gives it back (reattach)
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._reusable and self._aborted is None:
            with _idle_lock:
                idle = _idle.setdefault((self.host, self.port), [])
                if len(idle) < MAX_IDLE_PER_ENGINE:
                    idle.append(conn)
                    return
        conn.close()

    # -- the call ------------------------------------------------------------------
    def start(self) -> None:
        """Send the request now and read the answer later (:meth:`stream`), so
        what the caller does meanwhile (the dispatch's own Redis writes)
        overlaps the engine's work instead of preceding it. Only on a pooled
        keep-alive connection; best effort: without one, or on a failure here,
        :meth:`stream` sends the request and reports what it means."""
        if self.prefill_url or self._started is not None:
            return  # disaggregated: the prefill instance comes first
        with _idle_lock:
            idle = _idle.get((self.host, self.port))
            conn = idle.pop() if idle else None  # the most recently used: likeliest alive
        if conn is None:
            # a new connection's connect waits on the engine (up to the connect
            # timeout, were it unreachable): not on the caller's time
            return
        try:
            self._started = self._request(reuse=True, conn=conn)
        except Exception:  # noqa: BLE001 - stream() sends again and raises what it means
            self._close(conn)

    def discard(self, reason: str) -> None:
        """A started call whose stream will not be read: abort it and close."""
        self.abort(reason)
        self._started = None
        self._give_back()

    def _request(
        self, reuse: bool, conn: http.client.HTTPConnection | None = None
    ) -> http.client.HTTPConnection:
        """Write the request on ``conn``, else a pooled (``reuse``) or new
        connection (which :attr:`_fresh` tells). Raises what ``http.client``
        raises."""
        payload = json.dumps(self.body).encode()
        hdrs = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "X-Request-Id": self.request_id,
            **self.headers,
        }
        # a legacy completion (``prompt``, /v1/completions) goes to the engine's own
        path = "/v1/completions" if "prompt" in self.body else "/v1/chat/completions"
        if conn is None:
            conn = self._take_conn(reuse=reuse)
        self._fresh = conn.sock is None
        with self._lock:
            self._conn = conn
            if self._aborted:
                raise self._abort_error()
        conn.request("POST", path, body=payload, headers=hdrs)
        if conn.sock is not None:
            conn.sock.settimeout(self._timeout_s)
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _send(self) -> http.client.HTTPResponse:
        for attempt in range(2):  # a pooled keep-alive connection may have gone stale
            conn, self._started = self._started, None
            try:
                if conn is None:
                    conn = self._request(reuse=attempt == 0)
                return conn.getresponse()
            except (
                ConnectionError,
                http.client.RemoteDisconnected,
                http.client.BadStatusLine,
            ) as exc:
                self._close(conn)
                if self._aborted:
                    raise self._abort_error() from None
                if self._fresh or attempt:
                    raise EngineError(
                        f"engine {self.base_url} unreachable: {exc!r}", 503, kind="connect"
                    ) from None
            except TimeoutError:
                self._close(conn)
                raise EngineError(
                    f"engine {self.base_url} did not answer within {self._timeout_s:.1f}s",
                    504,
                    kind="stall",
                ) from None
            except OSError as exc:
                self._close(conn)
                if self._aborted:
                    raise self._abort_error() from None
                raise EngineError(
                    f"engine {self.base_url} unreachable: {exc!r}", 503, kind="connect"
                ) from None
        raise AssertionError("unreachable")

    def _close(self, conn: http.client.HTTPConnection | None) -> None:
        if conn is None:
            conn = self._conn
        if conn is not None:
            conn.close()
        self._conn = None

    def stream(self, coalesce_s: float = 0.0) -> Iterator[StreamPiece]:
        """Pieces of the completion, one per read of what the engine flushed;
        raises EngineError.

        ``coalesce_s``: after a piece with tokens, the next read waits until
        that long after it, so what the engine flushed meanwhile comes as one
        piece (one parse pass and one write downstream instead of one per
        token); the first token never waits."""
        if self.prefill_url:
            self.body = self._remote_prefill()
        resp = self._send()
        self._resp = resp
        try:
            if resp.status != 200:
                raw = resp.read()
                self._reusable = not resp.will_close
                raise _answered_error("engine", resp.status, raw)
            yield from self._pieces(resp, coalesce_s)
        finally:
            self._give_back()

    def _remote_prefill(self) -> dict[str, Any]:
        """vLLM's disaggregated serving (:mod:`tokenfleet.emulator.pd`): the
        prompt is prefilled on :attr:`prefill_url` (one token, not streamed),
        which keeps its KV and answers with ``kv_transfer_params``; the body
        returned carries them, so this call's engine pulls the KV instead of
        prefilling. A failure is an :class:`EngineError` like the engine's own
        (retryable: a re-send runs aggregated, see ``ChatJob.next_attempt``)."""
        body = {k: v for k, v in self.body.items() if k not in ("stream", "stream_options")}
        body.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        sub = EngineCall(  # all of it comes before the first token
            self.prefill_url,
            body,
            self.request_id,
            connect_timeout_s=self.connect_timeout_s,
            stall_timeout_s=self.first_token_timeout_s,
            headers=self.headers,
        )
        with self._lock:
            if self._aborted:
                raise self._abort_error()
            self._prefill = sub
        try:
            resp = sub._send()
            try:
                raw = resp.read()
            except TimeoutError:
                raise EngineError(
                    f"prefill engine {self.prefill_url} did not finish within "
                    f"{self.first_token_timeout_s:.1f}s",
                    504,
                    kind="stall",
                ) from None
            except (OSError, http.client.HTTPException) as exc:
                if self._aborted:
                    raise self._abort_error() from None
                raise EngineError(
                    f"prefill engine {self.prefill_url} broke off: {exc!r}", 502, kind="error"
                ) from None
            sub._reusable = not resp.will_close
        finally:
            sub._give_back()
            with self._lock:
                self._prefill = None
        if resp.status != 200:
            raise _answered_error("prefill engine", resp.status, raw)
        try:
            params = json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            raise EngineError(
                f"prefill engine {self.prefill_url} returned no kv_transfer_params: start it "
                "with a KV connector (vLLM --kv-transfer-config) or give its worker --role mixed",
                502,
                kind="error",
            )
        return {**self.body, "kv_transfer_params": params}

    def _read1(self, read1: Callable[[int], bytes], started: bool) -> bytes:
        """One read of the stream; a failure as the :class:`EngineError` it means."""
        try:
            return read1(65536)
        except TimeoutError:
            raise EngineError(
                f"engine {self.base_url} produced nothing for {self._timeout_s:.1f}s",
                504,
                True,
                started,
                kind="stall",
            ) from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if self._aborted:
                raise self._abort_error(started) from None
            raise EngineError(
                f"engine stream broke: {exc!r}", 502, True, started, kind="error"
            ) from None

    def _pieces(self, resp: http.client.HTTPResponse, coalesce_s: float) -> Iterator[StreamPiece]:
        """The body's SSE events, merged per read. A chunked body is read from
        the connection's buffer as it comes and decoded here: one read returns
        every chunk that arrived, where ``HTTPResponse.read1`` returns one
        chunk (one engine step) per call."""
        dec = self.decoder = StreamDecoder(resp.chunked)
        read1 = resp.fp.read1 if resp.chunked and resp.fp is not None else resp.read1
        last_s: float | None = None
        while not dec.done:
            if coalesce_s > 0 and last_s is not None:
                wait = last_s + coalesce_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            data = self._read1(read1, dec.started)
            if not data:
                if self._aborted:
                    raise self._abort_error(dec.started)
                if dec.chunked:
                    raise dec.broken("connection closed inside the stream")
                break
            piece = dec.feed(data)
            if piece is None:
                continue
            if piece.tokens:
                last_s = time.monotonic()
                if self._timeout_s != self.stall_timeout_s:  # past the prefill
                    self._timeout_s = self.stall_timeout_s
                    conn = self._conn
                    if conn is not None and conn.sock is not None:
                        conn.sock.settimeout(self._timeout_s)
            yield piece
        piece = dec.finish()
        if piece is not None:
            yield piece
        # the whole body was read: the connection serves the next request
        self._reusable = not resp.will_close and dec.clean
        if dec.chunked:
            resp.close()  # read past http.client: it must not think the body pending

    # -- hand-over to another reader (tokenfleet.live.gateway.pump) ------------------
    def detach(self) -> tuple[socket.socket, bytes] | None:
        """Hand the rest of a chunked stream to another reader: the engine
        socket, made non-blocking, and the bytes already buffered for it
        (:attr:`decoder` holds the decoding state). None when the call cannot
        be handed over (not chunked, no socket, read to its end). The connection stays this
        call's; :meth:`reattach` gives it back once the reader is done."""
        resp, conn, dec = self._resp, self._conn, self.decoder
        if resp is None or conn is None or dec is None or not dec.chunked or resp.fp is None:
            return None
        if dec.done:
            return None  # the body is read already (a short answer): nothing to hand over
        sock = conn.sock
        if not isinstance(sock, socket.socket):
            return None
        self._detached = True
        sock.setblocking(False)
        try:
            buffered = resp.fp.read1(65536)  # non-blocking: what is buffered, or b""
        except (BlockingIOError, InterruptedError):
            buffered = b""
        return sock, buffered or b""

    def reattach(self, finished: bool) -> None:
        """The other reader is done: the connection serves the next request if
        the body was read to its end, else it is closed."""
        self._detached = False
        conn, resp, dec = self._conn, self._resp, self.decoder
        if finished and conn is not None and conn.sock is not None and dec is not None:
            self._reusable = resp is not None and not resp.will_close and dec.clean
            try:
                conn.sock.settimeout(self.stall_timeout_s)
            except OSError:
                self._reusable = False
            if resp is not None:
                resp.close()
        else:
            self._reusable = False
        self._give_back()

    def abort(self, reason: str) -> None:
        """Thread-safe: close the socket under the reader (the engine aborts)."""
        with self._lock:
            self._aborted = reason
            conn = self._conn
            prefill = self._prefill
        if prefill is not None:
            prefill.abort(reason)
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def _abort_error(self, started: bool = False) -> EngineError:
        return EngineError(f"aborted: {self._aborted}", 499, False, started, kind="aborted")


#: the first-token timeout allows this many times the prompt's own prefill
#: time on the profile (queueing behind other prefills, a slower engine)
FIRST_TOKEN_PREFILL_FACTOR = 3.0


def first_token_timeout_s(stall_s: float, profile: EngineProfile, uncached_tokens: int) -> float:
    """How long an engine may send nothing before a request's first token.

    vLLM streams nothing while it prefills: a 100k-token prompt takes seconds
    on an H200, longer behind other prefills. A flat stall timeout aborted such
    requests and re-sent them (each attempt re-doing the prefill) until they
    failed; the Rust routers served them. The stall timeout applies again
    after the first token."""
    return stall_s + FIRST_TOKEN_PREFILL_FACTOR * profile.prefill_time_s(max(0, uncached_tokens))


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


class StreamDecoder:
    """An engine's SSE body, decoded from bytes as they arrive: one piece per
    feed (the events it completed, merged). Shared by :meth:`EngineCall.stream`,
    which reads on the request's thread, and the process's stream pump, which
    reads many calls on one (``tokenfleet.live.gateway.pump``)."""

    __slots__ = ("chunked", "frames", "buf", "started")

    def __init__(self, chunked: bool) -> None:
        self.chunked = chunked
        self.frames = _Dechunker() if chunked else None
        self.buf = b""  # SSE text not yet ended by a blank line
        self.started = False  # a token was decoded

    @property
    def done(self) -> bool:
        """The chunked body's last chunk (and trailer) arrived."""
        return self.frames is not None and self.frames.done

    @property
    def clean(self) -> bool:
        """Nothing past the body was received (the connection can be reused)."""
        return self.frames is None or not self.frames.rest

    def broken(self, why: str) -> EngineError:
        return EngineError(f"engine stream broke: {why}", 502, True, self.started, kind="error")

    def feed(self, data: bytes) -> StreamPiece | None:
        """The events ``data`` completes, merged; raises :class:`EngineError`."""
        if self.frames is not None:
            try:
                data = self.frames.feed(data)
            except ValueError as exc:
                raise self.broken(str(exc)) from None
        buf = self.buf + data if self.buf else data
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self.buf = buf
            return None
        block, self.buf = buf[: cut + 2], buf[cut + 2 :]
        piece = _parse_events(block, self.started)
        if piece is not None and piece.tokens:
            self.started = True
        return piece

    def finish(self) -> StreamPiece | None:
        """What is left once the body ended (events without a final blank line)."""
        rest, self.buf = self.buf, b""
        return _parse_events(rest, self.started) if rest.strip() else None


class _Dechunker:
    """HTTP/1.1 chunked transfer coding, decoded from bytes as they arrive."""

    __slots__ = ("rest", "left", "crlf", "trailer", "done")

    def __init__(self) -> None:
        self.rest = b""  # bytes not decoded yet (a partial size line)
        self.left = 0  # bytes of the current chunk's data still to come
        self.crlf = False  # the CRLF after a chunk's data is due
        self.trailer = False  # the last chunk was seen: trailer lines until an empty one
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """The payload in ``data`` (with what an earlier call left over)."""
        buf = self.rest + data if self.rest else data
        out: list[bytes] = []
        i, n = 0, len(buf)
        while i < n and not self.done:
            if self.left:
                take = min(self.left, n - i)
                out.append(buf[i : i + take])
                i += take
                self.left -= take
                self.crlf = self.left == 0
                continue
            if self.crlf:
                if n - i < 2:
                    break
                if buf[i : i + 2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                i += 2
                self.crlf = False
                continue
            j = buf.find(b"\r\n", i)
            if j < 0:
                break
            line, i = buf[i:j], j + 2
            if self.trailer:
                self.done = not line
                continue
            size = int(line.split(b";", 1)[0].strip() or b"x", 16)
            if size == 0:
                self.trailer = True
            self.left = size
        self.rest = buf[i:]
        return b"".join(out)


def _answered_error(who: str, status: int, raw: bytes) -> EngineError:
    """An engine's non-200 answer as the error it means: 4xx is the request's
    own fault (another engine says the same), 5xx and 429 are worth a re-send."""
    retryable = status >= 500 or status == 429
    return EngineError(
        f"{who} answered {status}: {_error_message(raw) or f'HTTP {status}'}",
        status,
        retryable,
        kind="error" if retryable else "client",
    )


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


#: a token's event as vLLM (compact JSON) and the emulator (spaced) write it:
#: one choice, a content delta, nothing after the choices. Matched, it is read
#: without parsing the whole event; anything else (a role, usage, a finish
#: reason, an error, fields another server adds) takes the full parse.
_PLAIN_TAIL = (
    rb'"choices": ?\[\{"index": ?0, ?"delta": ?\{"content": ?"((?:[^"\\]|\\.)*)"\}, ?'
    rb'"logprobs": ?null, ?"finish_reason": ?null\}\]\}'
)
_PLAIN_DELTA = re.compile(_PLAIN_TAIL + rb"\s*$")
#: the same, for every line of a flush in one pass (their string bodies); the
#: caller checks that every event matched (a line's tail cannot match twice)
_PLAIN_EVENTS = re.compile(_PLAIN_TAIL + rb"[ \t\r]*$", re.MULTILINE)


def _parse_events(block: bytes, started: bool = False) -> StreamPiece | None:
    """Merge the SSE events of one flush into one piece. Per flush this ran a
    full JSON parse per token, the largest part of the stream pump's work per
    read (docs/benchmarks.md, section 14): plain token events take a shortcut,
    and a flush of nothing else (mid-stream, almost every one) is read in one
    regular-expression pass over the whole block."""
    bodies = _PLAIN_EVENTS.findall(block)
    if bodies and len(bodies) == block.count(b"data:"):
        joined = b"".join(bodies)
        if b"\\" in joined:  # escapes: each string's own JSON decoding
            merged = "".join(json.loads(b'"' + b + b'"') for b in bodies)
        else:
            merged = joined.decode()
        return StreamPiece(merged, len(bodies) - bodies.count(b""))
    piece = StreamPiece()
    seen = False
    for line in block.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        plain = _PLAIN_DELTA.search(line)
        if plain is not None:
            lit = plain.group(1)
            text = lit.decode() if b"\\" not in lit else json.loads(b'"' + lit + b'"')
            seen = True
            if text:
                piece.text += text
                piece.tokens += 1
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
            raise EngineError(
                f"engine stream error: {msg}", 502, True, started=started or bool(piece.tokens)
            )
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
