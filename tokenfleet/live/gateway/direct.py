"""The API's side of the direct path (:mod:`tokenfleet.live.direct`): its engine calls, watched.

While a request thread reads an engine's stream it blocks in the socket, so
the checks the relay path ran between entries run here, on one thread for
all of the process's direct calls, every :data:`TICK_S`: the client left, the
request timed out, and (at most twice a lease period, one pipelined round
trip for all calls) the worker holding the request's slot lost its lease or
the attempt was superseded (the worker re-sent it, or settled it). Each
closes the engine call with a reason the request thread then acts on. The
same thread renews the process's liveness key, by which a worker waiting for
an outcome tells a live API from a dead one, and the leases of the attempts
the process claimed itself (express dispatch).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from tokenfleet.live.config import LiveConfig
from tokenfleet.live.direct import API_ALIVE_LEASES, api_alive_key
from tokenfleet.live.engine_client import EngineCall
from tokenfleet.live.jobs import ChatJob
from tokenfleet.live.state import LiveState

log = logging.getLogger("tokenfleet.api")

#: how often the watch thread looks at its calls (seconds)
TICK_S = 0.25

#: after the first token, how long (in lease periods) a request's lease must
#: stay lapsed before the API ends its stream as lost
STREAMING_LEASE_GRACE_LEASES = 2.0

#: reasons a call is closed by the watch thread (``EngineCall.aborted``)
GONE = "client went away"
LOST = "worker lost"
DEADLINE = "request timeout"
SUPERSEDED = "attempt superseded"


def engine_call(facts: dict[str, str], job: ChatJob, live: LiveConfig) -> EngineCall:
    """The engine call a ``go`` hand-over's facts describe (``RelayWriter.go_fields``)."""
    return EngineCall(
        facts.get("u", ""),
        job.body,
        facts.get("e") or f"{job.request_id}-{int(facts.get('a') or 0)}",
        connect_timeout_s=live.engine_connect_timeout_s,
        stall_timeout_s=live.engine_stall_timeout_s,
        headers=job.engine_headers or None,
        prefill_url=facts.get("p", ""),
        first_token_timeout_s=float(facts.get("w") or 0.0),
    )


@dataclass(slots=True, eq=False)
class DirectCall:
    """One engine call of one attempt that a request thread is reading."""

    request_id: str
    attempt: int
    call: EngineCall
    deadline_s: float  # epoch
    client_gone: Callable[[], bool] | None = None
    #: monotonic time of the first of the checks in a row that found the lease
    #: missing after the first token (None: the last check found it)
    lease_missing_since: float | None = None
    #: this process claimed the attempt (express dispatch): the watch thread
    #: renews its lease, as a worker's watchdog does for its own
    owned: bool = False


class DirectCalls:
    """This process's direct engine calls and the thread that watches them."""

    def __init__(self, state: LiveState, live: LiveConfig, api_id: str = "") -> None:
        self.state = state
        self.live = live
        self.api_id = api_id or uuid.uuid4().hex[:12]
        self.alive_key = api_alive_key(state, self.api_id)
        #: the lease owner of the attempts this process claims itself
        self.owner = f"api:{self.api_id}"
        self._calls: set[DirectCall] = set()
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._alive_at = 0.0

    def __len__(self) -> int:
        return len(self._calls)

    def register(self, c: DirectCall) -> None:
        with self._lock:
            self._calls.add(c)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="direct-calls", daemon=True)
                self._thread.start()
        self._work.set()

    def unregister(self, c: DirectCall) -> None:
        with self._lock:
            self._calls.discard(c)

    def close(self) -> None:
        self._stop.set()
        self._work.set()
        if self._thread is not None:
            self._thread.join(timeout=3.0)

    def renew_alive(self) -> None:
        """The liveness key (workers waiting on this process look at it)."""
        ttl_ms = int(API_ALIVE_LEASES * self.live.lease_ttl_s * 1000)
        self.state.r.set(self.alive_key, 1, px=max(1000, ttl_ms))
        self._alive_at = time.monotonic()

    def _loop(self) -> None:
        checked = renewed = 0.0
        period = min(1.0, self.live.lease_ttl_s / 2)
        renew_every = self.live.lease_ttl_s / 3.0
        while not self._stop.is_set():
            with self._lock:
                calls = list(self._calls)
            if not calls:
                self._work.wait(1.0)
                self._work.clear()
                continue
            now_m = time.monotonic()
            try:
                if now_m - self._alive_at >= period:
                    self.renew_alive()
                if now_m - renewed >= renew_every:
                    renewed = now_m
                    owned = [c.request_id for c in calls if c.owned]
                    if owned:
                        self.state.renew_leases(owned, self.live.lease_ttl_s, self.owner)
                if now_m - checked >= period:
                    checked = now_m
                    self._check_state(calls)
            except redis.RedisError as exc:
                log.debug("direct calls: Redis unavailable (%r)", exc)
            now = time.time()
            for c in calls:
                if c.call.aborted is not None:
                    continue
                if c.client_gone is not None and c.client_gone():
                    c.call.abort(GONE)
                elif now > c.deadline_s:
                    c.call.abort(DEADLINE)
            self._stop.wait(TICK_S)

    def _check_state(self, calls: list[DirectCall], now_m: float | None = None) -> None:
        """One round trip: each request's lease, status and attempt."""
        now_m = time.monotonic() if now_m is None else now_m
        grace_s = STREAMING_LEASE_GRACE_LEASES * self.live.lease_ttl_s
        k = self.state.k
        with self.state.r.pipeline(transaction=False) as pipe:
            for c in calls:
                pipe.exists(k("lease", c.request_id))
                pipe.hmget(k("req", c.request_id), "status", "attempt", "first_token")
            replies = pipe.execute()
        for i, c in enumerate(calls):
            if c.call.aborted is not None:
                continue
            leased = bool(replies[2 * i])
            raw_status, raw_attempt, raw_first = replies[2 * i + 1]
            status = raw_status.decode() if raw_status else ""
            attempt = int(raw_attempt or 0)
            if status != "running" or attempt != c.attempt:
                if status:  # a state lost with Redis is the request thread's to judge
                    c.call.abort(SUPERSEDED)
            elif leased or c.owned:  # an owned lease is renewed by this thread
                c.lease_missing_since = None
            elif raw_first != b"1":
                c.call.abort(LOST)  # before the first token: re-sent elsewhere at once
            else:
                # streaming: the engine still feeds this process and nothing can take
                # the request over, so end it only when the lease stays lapsed for
                # a while (the worker takes a lapsed lease back when it was starved
                # of CPU, not lost: workers/runtime.py, the watchdog; a burst of
                # streams ending together starved workers for seconds)
                if c.lease_missing_since is None:
                    c.lease_missing_since = now_m
                elif now_m - c.lease_missing_since >= grace_s:
                    c.call.abort(LOST)
