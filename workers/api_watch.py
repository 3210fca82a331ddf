"""One thread per worker watches the APIs its direct requests wait on.

A worker holding a direct request (:mod:`tokenfleet.live.direct`) waits for
the API's outcome entries, and meanwhile must notice two things that no entry
will tell it: the API process died (its liveness key lapsed), or the request
was settled without it (the API's own verdict after its outcome entry was
lost to a Redis outage). Each waiting thread used to wake every half lease to
ask: with a thousand streams that was about 670 wake-ups a second per worker
and a status read every 10 ms, for nothing while every API was fine
(docs/benchmarks.md, "Holding 2,000 streams"). Here one thread asks for all
of them, each API's key once and the statuses in one pipeline, and wakes only
the waiters it has news for (:meth:`Waiting.tell`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from tokenfleet.live.state import LiveState

log = logging.getLogger("tokenfleet.worker")

#: a waiter's request status is read at most this often: a request settled
#: while its API streamed is rare (the API's outcome entry lost to an outage)
SETTLED_CHECK_S = 10.0

#: what the watch tells a waiter
API_LOST = "api_lost"
SETTLED = "settled"


@dataclass(eq=False)
class Waiting:
    """One request a worker thread waits on (registered with :class:`ApiWatch`)."""

    request_id: str
    alive_key: str  # the liveness key of the API streaming it
    tell: Callable[[str], None]  # wakes the waiting thread with API_LOST or SETTLED
    sent_m: float = field(default_factory=time.monotonic)  # when ``go`` was sent
    status_at_m: float = field(default_factory=time.monotonic)


class ApiWatch:
    """Every ``period_s``: the liveness of each API with waiters (past their
    first lease: a fresh hand-over may not have reached its API yet), and
    every :data:`SETTLED_CHECK_S` each waiter's request status."""

    def __init__(
        self,
        state: LiveState,
        lease_ttl_s: float,
        api_alive: Callable[[str], bool] | None = None,
        period_s: float | None = None,
    ) -> None:
        """``api_alive(key)``: whether an API's liveness key exists (default:
        asks Redis; each key is asked once per round)."""
        self.state = state
        self.lease_ttl_s = lease_ttl_s
        self.api_alive = api_alive or (lambda key: bool(state.r.exists(key)))
        self.period_s = max(0.05, lease_ttl_s / 2) if period_s is None else period_s
        self._waiting: set[Waiting] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, w: Waiting) -> None:
        with self._lock:
            self._waiting.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="api-watch", daemon=True)
                self._thread.start()

    def discard(self, w: Waiting) -> None:
        with self._lock:
            self._waiting.discard(w)

    def __len__(self) -> int:
        return len(self._waiting)

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check(time.monotonic())
            except redis.RedisError as exc:  # a blip: look again next period
                log.debug("API watch: Redis unavailable (%r)", exc)
            except Exception:
                log.exception("API watch failed")

    def check(self, now_m: float) -> int:
        """One round; returns how many waiters were told something."""
        with self._lock:
            due = [w for w in self._waiting if now_m - w.sent_m > self.lease_ttl_s]
        if not due:
            return 0
        alive = {key: self.api_alive(key) for key in {w.alive_key for w in due}}
        ask = [w for w in due if alive[w.alive_key] and now_m - w.status_at_m > SETTLED_CHECK_S]
        done: set[Waiting] = set()
        if ask:
            k = self.state.k
            with self.state.r.pipeline(transaction=False) as pipe:
                for w in ask:
                    pipe.hget(k("req", w.request_id), "status")
                statuses = pipe.execute()
            for w, status in zip(ask, statuses, strict=True):
                w.status_at_m = now_m
                if status == b"done":
                    done.add(w)
        told = 0
        for w in due:
            if not alive[w.alive_key]:
                w.tell(API_LOST)
            elif w in done:
                w.tell(SETTLED)
            else:
                continue
            told += 1
        return told
