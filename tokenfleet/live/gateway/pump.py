"""The stream pump: one thread carries every direct stream past its first token.

A request thread that read a stream itself woke for every flush of its
engine and ran it through four generators, werkzeug's response iterator and
cheroot's pure-Python buffered writer before the bytes reached the client.
With a few hundred streams open, hundreds of threads took turns at the
interpreter for that: the process spent a core on it and ``/health`` waited
seconds for its turn (docs/benchmarks.md, "Overload"). Here the first token
still leaves on the request's thread (its time to first token is untouched),
then the thread hands the engine socket and the client socket to the pump
and sleeps on an event until the stream ends. The pump waits on all of them
in one ``epoll``; per flush it decodes the engine's events
(:class:`~tokenfleet.live.engine_client.StreamDecoder`), frames the chunks
and sends them without blocking. A request thread then costs memory only,
and the threads that want the interpreter are few.

The pump only moves bytes; what a stream's end means (the worker's outcome
entry, the ledger row, a re-send) stays with the request thread, which
wakes with a :class:`PumpResult`: tokens, finish reason and usage, or the
:class:`~tokenfleet.live.engine_client.EngineError` the thread would have
raised itself. The watch thread's checks (client gone, lease lost, deadline)
keep working: they close the engine socket, which ends the pumped stream.
"""

from __future__ import annotations

import heapq
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.live.engine_client import EngineCall, EngineError, StreamPiece
from tokenfleet.live.gateway.direct import GONE

log = logging.getLogger("tokenfleet.api")

#: how often the pump looks at stalls and idle streams (seconds)
TICK_S = 0.25
#: coalescing jobs due within this much of each other are read in one round
SWEEP_SLACK_S = 0.002
#: a streamed client gets a keep-alive comment after this long without bytes
KEEPALIVE_S = 5.0
_READ_BYTES = 65536
_E, _C = 0, 1  # which socket of a job a selector key is


@dataclass(slots=True, eq=False)
class PumpSink:
    """Where a stream's tokens go: the client's socket (framed SSE chunks when
    ``frame`` is set, else text collected for one JSON answer)."""

    sock: socket.socket
    #: text -> the SSE event bytes of one chunk; None: collect the text
    frame: Callable[[str], bytes] | None
    #: the response's head has been sent (the pump writes body bytes only)
    ready: Callable[[], bool] = lambda: True
    #: the response uses chunked transfer coding (HTTP/1.1 without a length)
    chunked: Callable[[], bool] = lambda: True


@dataclass(slots=True)
class PumpResult:
    """How a pumped stream ended."""

    tokens: int = 0
    text: str = ""  # collected text (a sink without ``frame``)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: EngineError | None = None
    client_failed: bool = False  # a write to the client failed: it went away


@dataclass(eq=False)
class _Job:
    call: EngineCall
    engine: socket.socket
    client: socket.socket
    sink: PumpSink
    pending: bytes
    coalesce_s: float
    stall_s: float
    chunked: bool = True
    out: bytearray = field(default_factory=bytearray)
    parts: list[str] = field(default_factory=list)
    result: PumpResult = field(default_factory=PumpResult)
    done: threading.Event = field(default_factory=threading.Event)
    client_timeout: float | None = None
    last_data_s: float = 0.0
    last_sent_s: float = 0.0
    reading: bool = False  # the engine socket is registered for reads
    watching: int = 0  # the client socket's registered events
    ended: bool = False  # the engine's body ended; flushing what is left


class StreamPump:
    """One thread, one selector, every stream of the process past its first token."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._new: list[_Job] = []
        self._lock = threading.Lock()
        self._jobs: set[_Job] = set()
        self._timers: list[tuple[float, int, _Job]] = []  # (read again at, seq, job)
        self._seq = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.carried = 0  # streams handed over so far
        self.reads = 0  # engine socket reads that returned bytes

    def __len__(self) -> int:
        return len(self._jobs)

    # -- the request thread's side ----------------------------------------------------
    def carry(
        self, call: EngineCall, sink: PumpSink, *, coalesce_s: float, stall_s: float
    ) -> PumpResult | None:
        """Carry ``call``'s stream to its end; blocks until then. None when the
        call cannot be handed over (the caller reads it itself)."""
        if not sink.ready():
            return None
        detached = call.detach()
        if detached is None:
            return None
        engine, pending = detached
        self.carried += 1
        now = time.monotonic()
        job = _Job(call, engine, sink.sock, sink, pending, coalesce_s, stall_s)
        job.chunked = sink.chunked()
        job.last_data_s = job.last_sent_s = now
        try:
            job.client_timeout = sink.sock.gettimeout()
            sink.sock.setblocking(False)
        except OSError:
            call.reattach(False)
            return PumpResult(client_failed=True)
        with self._lock:
            if self._stop:
                sink.sock.settimeout(job.client_timeout)
                call.reattach(False)
                return None
            self._new.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="stream-pump", daemon=True)
                self._thread.start()
        self._wake()
        job.done.wait()
        try:
            sink.sock.settimeout(job.client_timeout)
        except OSError:
            job.result.client_failed = True
        call.reattach(job.result.error is None and not job.result.client_failed)
        job.result.text = "".join(job.parts)
        return job.result

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=3.0)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already

    # -- the pump's thread --------------------------------------------------------------
    def _loop(self) -> None:
        next_tick = time.monotonic() + TICK_S
        while True:
            now = time.monotonic()
            timeout = next_tick - now
            if self._timers:
                timeout = min(timeout, self._timers[0][0] - now)
            try:
                events = self._sel.select(max(0.0, timeout))
            except OSError:  # a socket closed under the selector: the tick sorts it out
                events = []
            for key, mask in events:
                if key.data is None:
                    self._take_new()
                    continue
                job, which = key.data
                if job.done.is_set():
                    continue
                self._on_event(job, which, mask)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now + SWEEP_SLACK_S:
                _, _, job = heapq.heappop(self._timers)
                if not job.done.is_set():
                    self._on_due(job)
            if now >= next_tick:
                next_tick = now + TICK_S
                self._tick(now)
            with self._lock:
                if self._stop:
                    break
        with self._lock:
            waiting, self._new = self._new, []
        for job in [*self._jobs, *waiting]:
            self._end(job, EngineError("the API is stopping", 503, True, True, kind="aborted"))
        self._sel.close()

    def _on_event(self, job: _Job, which: int, mask: int) -> None:
        """One selector event of one job; whatever it raises ends that job only."""
        try:
            if which == _E:
                self._read(job)
            else:
                if mask & selectors.EVENT_READ:
                    self._client_readable(job)
                if mask & selectors.EVENT_WRITE and not job.done.is_set():
                    self._flush(job)
        except Exception as exc:  # noqa: BLE001 - logged by _failed; one stream only
            self._failed(job, exc)

    def _take_new(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            new, self._new = self._new, []
        for job in new:
            self._jobs.add(job)
            try:
                self._watch_client(job, selectors.EVENT_READ)
                if job.pending:
                    data, job.pending = job.pending, b""
                    self._consume(job, data)
                if not job.done.is_set() and not job.ended:
                    self._want_read(job)
            except Exception as exc:  # noqa: BLE001 - logged by _failed
                self._failed(job, exc)

    def _want_read(self, job: _Job) -> None:
        if not job.reading and not job.ended:
            try:
                self._sel.register(job.engine, selectors.EVENT_READ, (job, _E))
                job.reading = True
            except (OSError, ValueError, KeyError) as exc:
                self._end(job, self._broken(job, exc))

    def _read(self, job: _Job) -> None:
        """The engine socket is readable (it was waited on: nothing had come at
        the last look)."""
        if not self._recv(job):
            return
        if job.coalesce_s > 0 and job.reading and not job.done.is_set() and not job.ended:
            # what the engine flushes meanwhile comes as one piece, one chunk
            self._sel.unregister(job.engine)
            job.reading = False
            self._rest(job)

    def _rest(self, job: _Job) -> None:
        """Look at the engine socket again at the next multiple of ``coalesce_s``
        on the monotonic clock, without the selector: every stream resting on
        the same interval is read in the same round, one wake-up of this
        thread for all of them instead of one each."""
        q = job.coalesce_s
        self._seq += 1
        heapq.heappush(self._timers, ((time.monotonic() // q + 1) * q, self._seq, job))

    def _on_due(self, job: _Job) -> None:
        """A coalescing job's time to read. Mid-stream the engine has almost
        always flushed meanwhile, so read at once: registering the socket to
        wait on it and taking it out again after the read were two system
        calls and a selector round per read, most of the pump's CPU
        (docs/benchmarks.md, section 14). Only when nothing came is the socket
        waited on."""
        try:
            if job.ended or job.reading:
                return
            got = self._recv(job, wait=True)
            if got and not job.done.is_set() and not job.ended:
                self._rest(job)
        except Exception as exc:  # noqa: BLE001 - logged by _failed; one stream only
            self._failed(job, exc)

    def _recv(self, job: _Job, wait: bool = False) -> bool:
        """Read and consume what the engine sent; False if nothing was there
        (``wait``: the socket is then waited on) or the stream ended badly."""
        try:
            data = job.engine.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            if wait:
                self._want_read(job)
            return False
        except OSError as exc:
            self._end(job, self._broken(job, exc))
            return False
        if not data:
            self._end(job, self._broken(job, None))
            return False
        self.reads += 1
        self._consume(job, data)
        return True

    def _consume(self, job: _Job, data: bytes) -> None:
        job.last_data_s = time.monotonic()
        dec = job.call.decoder
        assert dec is not None
        try:
            piece = dec.feed(data)
            if piece is not None:
                self._deliver(job, piece)
            if dec.done:
                last = dec.finish()
                if last is not None:
                    self._deliver(job, last)
        except EngineError as exc:
            self._end(job, exc)
            return
        if dec.done:
            job.ended = True
            if job.reading:
                self._sel.unregister(job.engine)
                job.reading = False
            if not job.out:
                self._end(job, None)

    def _deliver(self, job: _Job, piece: StreamPiece) -> None:
        res = job.result
        res.tokens += piece.tokens
        if piece.finish_reason:
            res.finish_reason = piece.finish_reason
        if piece.usage is not None:
            res.usage = piece.usage
        if not piece.text:
            return
        if job.sink.frame is None:
            job.parts.append(piece.text)
        else:
            self._send(job, job.sink.frame(piece.text))

    def _send(self, job: _Job, event: bytes) -> None:
        if job.chunked:
            event = b"%x\r\n%s\r\n" % (len(event), event)
        job.out += event
        self._flush(job)

    def _flush(self, job: _Job) -> None:
        while job.out:
            try:
                n = job.client.send(job.out)
            except (BlockingIOError, InterruptedError):
                self._watch_client(job, selectors.EVENT_READ | selectors.EVENT_WRITE)
                return
            except OSError:
                job.result.client_failed = True
                job.call.abort(GONE)
                self._end(job, None)
                return
            del job.out[:n]
            job.last_sent_s = time.monotonic()
        self._watch_client(job, selectors.EVENT_READ)
        if job.ended:
            self._end(job, None)

    def _client_readable(self, job: _Job) -> None:
        """EOF (or a reset) from the client: it went away; pipelined bytes of a
        next request are not, and stop being watched."""
        try:
            data = job.client.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._watch_client(job, job.watching & ~selectors.EVENT_READ)
            return
        job.result.client_failed = True
        job.call.abort(GONE)
        self._end(job, None)

    def _watch_client(self, job: _Job, events: int) -> None:
        if events == job.watching:
            return
        try:
            if not events:
                self._sel.unregister(job.client)
            elif not job.watching:
                self._sel.register(job.client, events, (job, _C))
            else:
                self._sel.modify(job.client, events, (job, _C))
            job.watching = events
        except (OSError, ValueError, KeyError):
            job.result.client_failed = True
            self._end(job, None)

    def _tick(self, now: float) -> None:
        for job in list(self._jobs):
            if job.done.is_set() or job.ended:
                continue
            if job.call.aborted is not None and not job.reading:
                self._end(job, self._broken(job, None))  # closed while waiting to read
            elif now - job.last_data_s > job.stall_s:
                self._end(
                    job,
                    EngineError(
                        f"engine {job.call.base_url} produced nothing for {job.stall_s:.1f}s",
                        504,
                        True,
                        True,
                        kind="stall",
                    ),
                )
            elif job.sink.frame is not None and now - job.last_sent_s > KEEPALIVE_S:
                self._send(job, b": keep-alive\n\n")

    def _failed(self, job: _Job, exc: Exception) -> None:
        """The pump's own code raised on one stream: end that stream only."""
        log.exception("stream pump: request %s", job.call.request_id)
        self._end(job, EngineError(f"stream pump failed: {exc!r}", 502, True, True))

    def _broken(self, job: _Job, exc: BaseException | None) -> EngineError:
        why = job.call.aborted
        if why:
            return EngineError(f"aborted: {why}", 499, False, True, kind="aborted")
        detail = repr(exc) if exc is not None else "connection closed inside the stream"
        return EngineError(f"engine stream broke: {detail}", 502, True, True, kind="error")

    def _end(self, job: _Job, error: EngineError | None) -> None:
        if job.done.is_set():
            return
        if job.reading:
            self._unregister(job.engine)
            job.reading = False
        if job.watching:
            self._unregister(job.client)
            job.watching = 0
        if error is not None and job.result.error is None and not job.result.client_failed:
            job.result.error = error
        self._jobs.discard(job)
        job.done.set()

    def _unregister(self, sock: socket.socket) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
