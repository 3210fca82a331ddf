"""Token relay over Redis Streams: one stream per request, worker -> API.

A stream (not pub/sub) because a reader that attaches late, or reconnects
after a Redis blip, still gets every entry from the start; and it lets the
API thread block on exactly its own request (``XREAD BLOCK``) instead of
holding a Celery ``AsyncResult.get()`` in a web thread. One entry per engine
step (the engine writes a step's tokens in one chunk), not per token.

Entry kinds (field ``k``): ``d`` text delta (``t`` text, ``n`` tokens),
``end`` (``f`` finish reason, ``u`` usage JSON), ``err`` (``m`` message,
``c`` HTTP-ish code, ``y`` OpenAI error type), ``retry`` (``a`` new attempt:
the previous attempt failed before its first token and was re-sent).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.live.state import LiveState


@dataclass(slots=True)
class RelayEvent:
    kind: str  # "d" | "end" | "err" | "retry" | "idle"
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
    return RelayEvent(kind, attempt=int(fields.get(b"a", b"0")))


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


class RelayReader:
    """Reads one request's stream (API side), blocking in Redis, not in Python."""

    def __init__(self, state: LiveState, request_id: str, block_ms: int = 500) -> None:
        self.r = state.r
        self.key = state.stream_key(request_id)
        self.block_ms = block_ms
        self.last_id = "0-0"

    def events(self, on_idle: Callable[[], RelayEvent | None]) -> Iterator[RelayEvent]:
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
