"""Load shedding at the front door: refuse at once what would only wait.

Two rules, both answered before any engine work, with a ``Retry-After`` the
client can act on:

* **the process's bound** (:class:`InflightBound`): one API process holds at
  most ``api_max_inflight`` chat requests (streams included); the next one is
  answered 503 at once instead of waiting in the accept queue, where nobody
  can see it and ``/health`` queues behind it. ``Retry-After`` is the time
  this process needs, at its measured rate of finishing requests, to finish
  as many as were refused in the last second plus one: the refused clients
  come back spread over the time the process needs to make room for them.
* **the front gate** (:class:`FrontGate`): a request's CPU work before its
  dispatch (parse, tokenize, route, publish: about 4-10 ms on the 2-core
  development machine) runs for at most ``api_front_slots`` requests at a
  time. Threads past it block on a semaphore instead of competing for the
  interpreter's lock, so ``/health``, the token relay and the requests
  already admitted keep their turns; a request that cannot enter within
  ``api_front_wait_s`` is answered 503 (``Retry-After`` as for the bound).
  Without it, 200 arrivals a second made hundreds of threads runnable and
  ``/health`` took up to 15 s (docs/benchmarks.md, "Overload").
* **predicted wait over the tier's SLO** (:class:`WaitPredictor`): the
  requests queued in the chosen datacenter's broker queues ahead of this one
  (its tier and the tiers served before it), divided by the rate at which
  that datacenter's workers start requests, is the wait this request would
  see. Over the tier's TTFT limit (times ``shed_wait_factor``) it is refused
  with 429; ``Retry-After`` is the wait minus the limit: how long the queue,
  draining at the measured rate with nothing added, takes to get short
  enough for this request to meet its SLO.

Without them an overloaded process let every request in: at 100 req/s on a
two-engine fleet the clients timed out (30 s) on 2,804 of 3,000 requests
while the engines ran all of them for nobody (docs/benchmarks.md, "Overload").
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tokenfleet.core.tiers import SLOConfig
from tokenfleet.live.gateway.errors import AtCapacity, Overloaded
from tokenfleet.live.queues import TIER_PRIORITY

#: the window over which rates are measured (seconds)
RATE_WINDOW_S = 5.0


class _RateMeter:
    """Events per second over the last :data:`RATE_WINDOW_S` (monotonic clock)."""

    def __init__(self, window_s: float = RATE_WINDOW_S, started: float | None = None) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()
        self._started = time.monotonic() if started is None else started

    def add(self, now: float, n: int = 1) -> None:
        for _ in range(n):
            self._times.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()

    def count(self, now: float) -> int:
        self._trim(now)
        return len(self._times)

    def rate(self, now: float) -> float:
        """Per second; over the time observed so far while shorter than the window."""
        self._trim(now)
        span = min(self.window_s, max(0.5, now - self._started))
        return len(self._times) / span


class InflightBound:
    """At most ``limit`` chat requests in flight in this process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0
        self._lock = threading.Lock()
        self._finished = _RateMeter()
        self._refused = _RateMeter(window_s=1.0)

    def enter(self) -> None:
        """Take a place or raise :class:`Overloaded` (503) with an honest Retry-After."""
        with self._lock:
            if self.limit <= 0 or self.inflight < self.limit:
                self.inflight += 1
                return
            now = time.monotonic()
            self._refused.add(now)
            rate = self._finished.rate(now)
            waiting = self._refused.count(now) + 1
        retry = waiting / rate if rate > 0 else RATE_WINDOW_S
        raise Overloaded(
            f"this API process is at its limit of {self.limit} requests in flight; "
            "retry after the indicated delay (or send to another replica)",
            retry_after_s=retry,
        )

    def leave(self) -> None:
        with self._lock:
            self.inflight -= 1
            self._finished.add(time.monotonic())


class FrontGate:
    """At most ``slots`` requests in their CPU-bound front half at once.

    A request that finds every slot taken waits at most ``wait_s``; one whose
    predicted wait is already longer is refused at once, not after the wait.
    The prediction is the gate's capacity, not its recent traffic: the
    requests waiting ahead, times the mean time a request holds a slot, over
    the number of slots (Little's law for a saturated gate). A pass *rate*
    would read an idle process as a slow one and refuse the first burst
    after a quiet spell."""

    #: weight of the newest hold time in the running mean
    HOLD_EWMA_ALPHA = 0.2

    def __init__(
        self, slots: int, wait_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.slots = slots
        self.wait_s = wait_s
        self.clock = clock
        self._sem = threading.BoundedSemaphore(max(1, slots))
        self._lock = threading.Lock()
        self._entered = threading.local()
        #: mean seconds a request holds a slot (None: no request has left yet)
        self.mean_hold_s: float | None = None
        self._refused = _RateMeter(window_s=1.0, started=clock())
        self._waiting = 0

    def _turn_s(self, ahead: int) -> float | None:
        """Predicted wait of a request with ``ahead`` requests waiting before it."""
        if self.mean_hold_s is None:
            return None
        return (ahead + 1) * self.mean_hold_s / max(1, self.slots)

    def enter(self) -> None:
        if self.slots <= 0:
            return
        if not self._sem.acquire(blocking=False):
            with self._lock:
                wait = self._turn_s(self._waiting)
                hopeless = wait is not None and wait > self.wait_s
                if not hopeless:
                    self._waiting += 1
            acquired = False
            if not hopeless:
                try:
                    acquired = self._sem.acquire(timeout=self.wait_s)
                finally:
                    with self._lock:
                        self._waiting -= 1
            if not acquired:
                self._refuse()
        self._entered.at = self.clock()

    def _refuse(self) -> None:
        with self._lock:
            self._refused.add(self.clock())
            retry = self._turn_s(self._refused.count(self.clock()))
        raise Overloaded(
            "this API process cannot take more requests this second; "
            "retry after the indicated delay (or send to another replica)",
            retry_after_s=RATE_WINDOW_S if retry is None else retry,
        )

    def leave(self) -> None:
        if self.slots <= 0:
            return
        held_s = max(0.0, self.clock() - getattr(self._entered, "at", self.clock()))
        self._sem.release()
        with self._lock:
            a = self.HOLD_EWMA_ALPHA
            m = self.mean_hold_s
            self.mean_hold_s = held_s if m is None else (1 - a) * m + a * held_s


class WaitPredictor:
    """The queue wait a request would see in a datacenter, from the broker's
    queue depths and the rate the DC's workers start requests.

    The start rate is the growth of the instances' shared ``dispatched_total``
    (booked when a worker claims a pool request, and when the API sends one
    to an instance's own queue), sampled at most every ``sample_s``.
    """

    def __init__(self, slo: SLOConfig, factor: float = 1.0, sample_s: float = 0.1) -> None:
        self.slo = slo
        self.factor = factor
        self.sample_s = sample_s
        # dc -> deque of (monotonic time, sum of dispatched_total)
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._lock = threading.Lock()

    def start_rate(self, dc: str, total: int, now: float) -> float:
        """Starts per second in ``dc`` over the last window, given its current total."""
        with self._lock:
            s = self._samples.setdefault(dc, deque())
            if s and now - s[-1][0] > 2 * RATE_WINDOW_S:
                s.clear()  # idle for a while: the old samples would average in the idle time
            if not s or now - s[-1][0] >= self.sample_s or total < s[-1][1]:
                if s and total < s[-1][1]:  # counters reset (Redis restarted)
                    s.clear()
                s.append((now, total))
            while len(s) > 2 and s[1][0] <= now - RATE_WINDOW_S:
                s.popleft()
            t0, n0 = s[0]
        span = now - t0
        if span < 1.0:
            return math.nan  # not enough history yet: no prediction
        return (total - n0) / span

    def queued_ahead(self, tier: str, dc: str, depths: Mapping[str, int]) -> int:
        """Requests waiting in ``dc``'s queues of ``tier`` and the tiers before it."""
        order = TIER_PRIORITY.index(tier) if tier in TIER_PRIORITY else 0
        ahead = set(TIER_PRIORITY[: order + 1])
        n = 0
        for queue, k in depths.items():
            parts = queue.split(".")
            if k > 0 and len(parts) in (2, 3) and parts[0] == dc and parts[-1] in ahead:
                n += k
        return n

    def check(
        self,
        info: Any,
        dc: str,
        depths: Mapping[str, int],
        totals: Callable[[], Iterable[int]],
        now: float | None = None,
    ) -> float | None:
        """Raise :class:`AtCapacity` when the predicted wait exceeds the tier's
        limit; return the prediction (None when there is none)."""
        if self.factor <= 0:
            return None
        limit = self.slo.slo_for(info.tier).ttft_limit_s(info.input_tokens)
        if limit is None:
            return None
        ahead = self.queued_ahead(info.tier, dc, depths)
        now = time.monotonic() if now is None else now
        rate = self.start_rate(dc, sum(totals()), now)
        if ahead == 0:
            return 0.0
        if math.isnan(rate):
            return None
        # nothing started in the whole window: at most one start per window
        wait_s = ahead / max(rate, 1.0 / RATE_WINDOW_S)
        if wait_s <= self.factor * limit:
            return wait_s
        raise AtCapacity(
            f"TokenFleet is at capacity for {info.tier} requests: {ahead} requests wait "
            f"ahead of this one in {dc}, which starts {rate:.1f} per second, so the "
            f"predicted wait of {wait_s:.1f}s exceeds the tier's {limit:.1f}s limit; "
            "retry after the indicated delay",
            retry_after_s=wait_s - limit,
        )
