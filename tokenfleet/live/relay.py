"""Token relay over Redis Streams: one stream per request, worker -> API.

On the direct path (:mod:`tokenfleet.live.direct`, the default) a request's
stream carries only the worker's ``go`` hand-over, ``retry`` and the end
(``end``/``err``): the API reads the engine itself. What follows describes
the relay path, which still carries the tokens when ``direct_stream`` is off.

A stream (not pub/sub) because a reader that attaches late, or reconnects
after a Redis blip, still gets every entry from the start; and it lets the
API thread block on exactly its own request (``XREAD BLOCK``) instead of
holding a Celery ``AsyncResult.get()`` in a web thread. The first token is
one entry at once; after it the worker batches what the engine sends into
one entry at most every ``relay_flush_interval_s`` (20 ms) per request, not
one per token (docs/benchmarks.md, "CPU per request").

Entry kinds (field ``k``): ``d`` text delta (``t`` text, ``n`` tokens),
``end`` (``f`` finish reason, ``u`` usage JSON), ``err`` (``m`` message,
``c`` HTTP-ish code, ``y`` OpenAI error type), ``retry`` (``a`` new attempt:
the previous attempt failed before its first token and was re-sent), ``go``
(``u`` engine URL, ``e`` engine request id, ``a`` attempt, ``i`` instance,
``x`` engine KV events relayed); ``ft``/``out`` are the API's entries on an
attempt's outcome stream.

The API reads all its requests' streams through one :class:`RelayHub` per
process: one thread and one Redis connection run ``XREAD BLOCK`` over every
open stream at once and hand the entries to the waiting request threads.
Before it, each waiting request held its own blocking ``XREAD`` (a Redis
connection and a socket wait per stream), which tied the number of streams a
process could hold to its connection pool and thread pool (docs/live.md,
"Overload").
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.live.state import LiveState

log = logging.getLogger("tokenfleet.relay")


@dataclass(slots=True)
class RelayEvent:
    kind: str  # "d" | "end" | "err" | "retry" | "idle" | "gone" (the client left)
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    message: str = ""
    code: int = 0
    error_type: str = ""
    attempt: int = 0
    instance: str = ""
    #: ``end``: the worker's ledger facts (``s`` status, ``td``/``tf``/``te``
    #: dispatched/first token/finished epoch s, ``ca`` cached tokens), so the
    #: API can record the row too when the worker dies before its writer flushes
    ledger: dict[str, str] | None = None
    #: ``go``, ``ft``, ``out`` (the direct path, :mod:`tokenfleet.live.direct`): the entry's fields
    facts: dict[str, str] | None = None


def _decode(fields: dict[bytes, bytes]) -> RelayEvent:
    kind = fields[b"k"].decode()
    if kind == "d":
        return RelayEvent(
            "d",
            text=fields.get(b"t", b"").decode("utf-8", "replace"),
            tokens=int(fields.get(b"n", b"0")),
            instance=fields.get(b"i", b"").decode(),
        )
    if kind == "end":
        u = fields.get(b"u")
        return RelayEvent(
            "end",
            finish_reason=fields.get(b"f", b"stop").decode(),
            usage=json.loads(u) if u else None,
            instance=fields.get(b"i", b"").decode(),
            ledger={
                k: fields[k.encode()].decode()
                for k in ("s", "td", "tf", "te", "ca")
                if k.encode() in fields
            }
            or None,
        )
    if kind == "err":
        return RelayEvent(
            "err",
            message=fields.get(b"m", b"").decode("utf-8", "replace"),
            code=int(fields.get(b"c", b"500")),
            error_type=fields.get(b"y", b"server_error").decode(),
        )
    if kind in FACT_KINDS:
        return RelayEvent(
            kind,
            attempt=int(fields.get(b"a", b"0")),
            facts={k.decode(): v.decode("utf-8", "replace") for k, v in fields.items()},
        )
    return RelayEvent(kind, attempt=int(fields.get(b"a", b"0")))


#: entry kinds of the direct path whose fields are handed over as they are
FACT_KINDS = ("go", "ft", "out")
#: entry kinds after which nothing follows in a stream
TERMINAL_KINDS = ("end", "err", "out")


class RelayWriter:
    """Writes one request's stream (worker side)."""

    def __init__(
        self, state: LiveState, request_id: str, ttl_s: float, instance_id: str = ""
    ) -> None:
        self.r = state.r
        self.key = state.stream_key(request_id)
        self.ttl_s = int(ttl_s)
        self.instance_id = instance_id
        self._expiry_set = False

    def _add(self, fields: dict[str, Any], final: bool = False) -> None:
        if self._expiry_set and not final:
            self.r.xadd(self.key, fields)
            return
        with self.r.pipeline(transaction=False) as pipe:
            pipe.xadd(self.key, fields)
            pipe.expire(self.key, self.ttl_s)
            pipe.execute()
        self._expiry_set = True

    def delta_fields(self, text: str, tokens: int) -> dict[str, Any]:
        return {"k": "d", "t": text, "n": tokens, "i": self.instance_id}

    def end_fields(self, finish_reason: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "k": "end",
            "f": finish_reason or "stop",
            "u": json.dumps(usage) if usage else "",
            "i": self.instance_id,
        }

    def delta(self, text: str, tokens: int) -> None:
        self._add(self.delta_fields(text, tokens))

    def mark_expiry_set(self) -> None:
        """The caller wrote an entry and the stream's EXPIRE in its own pipeline."""
        self._expiry_set = True

    def end(self, finish_reason: str, usage: dict[str, Any] | None) -> None:
        self._add(self.end_fields(finish_reason, usage), final=True)

    @staticmethod
    def error_fields(
        message: str, code: int = 500, error_type: str = "server_error"
    ) -> dict[str, Any]:
        return {"k": "err", "m": message, "c": code, "y": error_type}

    def error(self, message: str, code: int = 500, error_type: str = "server_error") -> None:
        self._add(self.error_fields(message, code, error_type), final=True)

    def retry(self, attempt: int) -> None:
        self._add({"k": "retry", "a": attempt})

    def go_fields(
        self,
        url: str,
        engine_request_id: str,
        attempt: int,
        exact_kv_events: bool = False,
        prefill_url: str = "",
        first_token_timeout_s: float = 0.0,
    ) -> dict[str, Any]:
        """The direct path's hand-over: the API calls ``url`` itself (:mod:`.direct`);
        ``x`` 0: no engine KV events here, the API publishes the prompt's blocks;
        ``p``: disaggregated, the API prefills there first; ``w``: how long the
        engine may send nothing before the first token (the prompt's prefill)."""
        fields = {
            "k": "go",
            "u": url,
            "e": engine_request_id,
            "a": attempt,
            "i": self.instance_id,
            "x": int(exact_kv_events),
            "w": round(first_token_timeout_s, 3),
        }
        if prefill_url:
            fields["p"] = prefill_url
        return fields


class RelayReader:
    """Reads one request's stream (API side), blocking in Redis, not in Python."""

    def __init__(self, state: LiveState, request_id: str, block_ms: int = 500) -> None:
        self.r = state.r
        self.key = state.stream_key(request_id)
        self.block_ms = block_ms
        self.last_id = "0-0"

    def events(self, on_idle: Callable[[], RelayEvent | None]) -> Generator[RelayEvent, None, None]:
        """Events until ``end``/``err``. ``on_idle`` runs whenever nothing came
        for ``block_ms``; it may return a terminal event (timeout, lost
        worker) that ends the iteration, or raise; otherwise an ``idle`` event
        is yielded (a streaming response turns it into a keep-alive comment,
        which is also how it notices a client that went away)."""
        while True:
            try:
                resp = self.r.xread({self.key: self.last_id}, count=512, block=self.block_ms)
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.2)
                ev = on_idle()
                if ev is not None:
                    yield ev
                    return
                yield RelayEvent("idle")
                continue
            if not resp:
                ev = on_idle()
                if ev is not None:
                    yield ev
                    return
                yield RelayEvent("idle")
                continue
            for _key, entries in resp:
                for eid, fields in entries:
                    self.last_id = eid.decode() if isinstance(eid, bytes) else eid
                    ev = _decode(fields)
                    yield ev
                    if ev.kind in ("end", "err"):
                        return


class Subscription:
    """One request's stream as the hub delivers it (API side)."""

    __slots__ = ("hub", "key", "key_resp", "last_id", "inbox", "done")

    def __init__(self, hub: RelayHub, key: str) -> None:
        self.hub = hub
        self.key = key
        raw = key.encode()
        #: the key as a RESP bulk string, encoded once (the hub sends it on every read)
        self.key_resp = b"$%d\r\n%s\r\n" % (len(raw), raw)
        self.last_id = b"0-0"
        self.inbox: queue.SimpleQueue[RelayEvent] = queue.SimpleQueue()
        self.done = False

    def events(
        self, on_idle: Callable[[], RelayEvent | None], idle_ms: int = 250
    ) -> Generator[RelayEvent, None, None]:
        """Same contract as :meth:`RelayReader.events`: events until ``end`` or
        ``err``; ``on_idle`` runs when nothing came for ``idle_ms``. The
        subscription is closed when the iteration ends (or is closed)."""
        timeout_s = idle_ms / 1000.0
        try:
            while True:
                try:
                    ev = self.inbox.get(timeout=timeout_s)
                except queue.Empty:
                    idle = on_idle()
                    if idle is not None:
                        yield idle
                        return
                    yield RelayEvent("idle")
                    continue
                yield ev
                if ev.kind in ("end", "err"):
                    return
        finally:
            self.close()

    def close(self) -> None:
        self.hub.unsubscribe(self)


class RelayHub:
    """All of one API process's stream reads on one thread and one connection.

    :meth:`subscribe` registers a request's stream before its job is published;
    the pipeline that publishes it also writes the hub's wake-up entry
    (:meth:`wake`), which ends the hub's current ``XREAD BLOCK`` so the next
    one includes the new stream. The wake-up is an entry in a per-process
    stream (not ``CLIENT UNBLOCK``): it cannot be lost between the hub's
    reading its set of streams and blocking, because the next ``XREAD`` starts
    after the last wake-up entry it saw.

    ``XREAD`` over N streams costs O(N) to send and for Redis to answer, once
    per batch of entries instead of one round trip and one blocked thread per
    stream. The command is assembled from each stream's key encoded once
    (redis-py's packer took about 4.6 ms for 2,000 streams), and with many
    streams open the hub waits a little between reads so each read carries
    more entries (:meth:`pause_s`: nothing while fewer than 100 are open, at
    most 10 ms at 2,000).
    """

    #: longest XREAD BLOCK (ms): the hub re-reads its set at least this often
    BLOCK_MS = 1000
    #: entries per stream per XREAD
    COUNT = 512
    #: open streams below which the hub reads again at once
    PAUSE_FROM = 100

    def __init__(self, state: LiveState, client: redis.Redis | None = None) -> None:
        self.state = state
        # its own connection: a blocked XREAD must not hold one of the pool's
        shared = state.r.connection_pool
        kwargs = dict(shared.connection_kwargs)
        kwargs["socket_timeout"] = self.BLOCK_MS / 1000.0 + 10.0
        own = redis.ConnectionPool(connection_class=shared.connection_class, **kwargs)
        self.r = client or redis.Redis(connection_pool=own)
        self.wake_key = state.k("relay-wake", uuid.uuid4().hex[:12])
        self._subs: dict[str, Subscription] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_last = "0-0"
        self._thread = threading.Thread(target=self._loop, name="relay-hub", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._subs)

    def subscribe(self, request_id: str, key: str | None = None) -> Subscription:
        """``request_id``'s relay stream, or the stream ``key``."""
        sub = Subscription(self, key or self.state.stream_key(request_id))
        with self._lock:
            self._subs[sub.key] = sub
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub.done:
            return
        sub.done = True
        with self._lock:
            if self._subs.get(sub.key) is sub:
                del self._subs[sub.key]

    def wake(self, pipe: Any) -> None:
        """Add the wake-up entry to ``pipe`` (a pipeline that runs after :meth:`subscribe`)."""
        pipe.xadd(self.wake_key, {"w": 1}, maxlen=64, approximate=True)
        pipe.expire(self.wake_key, 3600)

    def wake_now(self) -> None:
        with self.state.r.pipeline(transaction=False) as pipe:
            self.wake(pipe)
            pipe.execute()

    def close(self) -> None:
        self._stop.set()
        try:
            self.wake_now()
        except redis.RedisError:
            pass
        self._thread.join(timeout=3.0)
        try:
            self.r.close()
        except Exception:  # noqa: BLE001
            pass

    @classmethod
    def pause_s(cls, n_streams: int) -> float:
        """Seconds between two reads with ``n_streams`` open: batches grow with
        the load, and the latency this adds stays below one engine step."""
        if n_streams < cls.PAUSE_FROM:
            return 0.0
        return min(0.010, n_streams / 200_000.0)

    def _command(self, subs: list[Subscription]) -> bytes:
        """``XREAD COUNT c BLOCK ms STREAMS wake k1.. wake-id id1..`` as RESP."""
        wake = self.wake_key.encode()
        parts = [
            b"*%d\r\n" % (8 + 2 * len(subs)),
            b"$5\r\nXREAD\r\n$5\r\nCOUNT\r\n",
            _bulk(str(self.COUNT).encode()),
            b"$5\r\nBLOCK\r\n",
            _bulk(str(self.BLOCK_MS).encode()),
            b"$7\r\nSTREAMS\r\n",
            _bulk(wake),
        ]
        parts.extend(sub.key_resp for sub in subs)
        parts.append(_bulk(self._wake_last.encode()))
        parts.extend(_bulk(sub.last_id) for sub in subs)
        return b"".join(parts)

    def _xread(self, subs: list[Subscription]) -> Any:
        pool = self.r.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([self._command(subs)])  # type: ignore[no-untyped-call]
            return conn.read_response()
        except BaseException:
            conn.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            pool.release(conn)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                subs = list(self._subs.values())
            try:
                resp = self._xread(subs)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("relay hub: Redis unavailable (%s); retrying", exc.__class__.__name__)
                self._stop.wait(0.2)
                continue
            except Exception:  # the hub must outlive any one bad reply
                log.exception("relay hub: XREAD failed; retrying")
                self._stop.wait(0.2)
                continue
            by_key = {sub.key: sub for sub in subs}
            for item in _stream_replies(resp):
                key, entries = item
                k = key.decode() if isinstance(key, bytes) else str(key)
                if not entries:
                    continue
                if k == self.wake_key:
                    last = entries[-1][0]
                    self._wake_last = last.decode() if isinstance(last, bytes) else str(last)
                    continue
                target = by_key.get(k)
                if target is None:
                    continue
                self._deliver(target, entries)
            pause = self.pause_s(len(subs))
            if pause:
                self._stop.wait(pause)

    def _deliver(self, sub: Subscription, entries: list[Any]) -> None:
        for eid, raw in entries:
            sub.last_id = eid if isinstance(eid, bytes) else str(eid).encode()
            fields = raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=True))
            ev = _decode(fields)
            sub.inbox.put(ev)
            if ev.kind in TERMINAL_KINDS:
                # nothing follows a terminal entry: stop reading the stream
                with self._lock:
                    if self._subs.get(sub.key) is sub:
                        del self._subs[sub.key]
                break


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _stream_replies(resp: Any) -> list[Any]:
    """XREAD's reply as ``[(key, [(id, fields), ...]), ...]`` (RESP2 array or RESP3 map)."""
    if not resp:
        return []
    if isinstance(resp, dict):
        return list(resp.items())
    return [(item[0], item[1]) for item in resp]
