"""Requests the admission policy queued, held in this API process until it releases them.

An admission policy answers an arrival with ``QUEUE`` when no instance
should take the request now (SLOMax: the long-context lane's slots are all
prefilling, or interactive requests already wait). The simulator's driver
keeps such requests in per-tier FIFOs and asks the policy's
``next_action`` whenever capacity may have freed; this is the same loop for
the live gateway's interactive and long-context requests, whose clients
wait on an open connection anyway. (Batch requests keep their broker queue,
which the workers' tier gates drain: thousands of them may wait.)

One thread per process runs the loop while anything is held: every
``tick_s`` it builds the policy's snapshot (the caller's ``release``) over
these queues and applies the actions it returns, one dispatch at a time: a
released request books its instance before the next decision, so two are
not sent into one freed slot. The request's own thread waits on its
:class:`Hold` and goes on with the instances the policy named, or ends as
the policy dropped it, or leaves the queue when its client goes away.
Replicas hold their own requests; each sees the others' dispatches through
the shared accounting, as it does at arrival.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tokenfleet.core.admission import DISPATCH, Action, QueuedRequest, TierQueue
from tokenfleet.core.types import RequestInfo

log = logging.getLogger("tokenfleet.api")

#: seconds a released request has to book its instance before the next decision
BOOK_WAIT_S = 0.1

#: (the held queues, now) -> the policy's next action over them (None: nothing now)
Release = Callable[[Mapping[str, TierQueue], float], Action | None]


@dataclass(slots=True)
class Hold:
    """One held request: what the policy decided for it, once it did."""

    info: RequestInfo
    decided: threading.Event = field(default_factory=threading.Event)
    action: Action | None = None
    #: set by the request's thread once its dispatch is written (or failed)
    booked: threading.Event = field(default_factory=threading.Event)


class HoldingPen:
    """Per-tier FIFOs of held requests and the thread that releases them."""

    def __init__(
        self, release: Release, tick_s: float = 0.005, book_wait_s: float = BOOK_WAIT_S
    ) -> None:
        self._release = release
        self.tick_s = tick_s
        self.book_wait_s = book_wait_s
        self.queues: dict[str, TierQueue] = {}
        self._holds: dict[str, Hold] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._holds)

    def totals(self) -> dict[str, tuple[int, int, int]]:
        """Per tier: held requests, their prompt tokens, prompt + output budget."""
        with self._lock:
            return {
                t: (len(q), q.input_tokens, q.reserved_tokens)
                for t, q in self.queues.items()
                if len(q)
            }

    def hold(self, info: RequestInfo, now_s: float) -> Hold:
        h = Hold(info)
        with self._lock:
            q = self.queues.get(info.tier)
            if q is None:
                q = self.queues[info.tier] = TierQueue(info.tier)
            q.append(QueuedRequest(info, now_s))
            self._holds[info.request_id] = h
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="holding", daemon=True)
                self._thread.start()
        self._wake.set()
        return h

    def wait(self, h: Hold, until_s: float, gone: Callable[[], bool] | None) -> Action | None:
        """The policy's action for ``h``; None when its client left or
        ``until_s`` (monotonic) passed first (it is no longer held then)."""
        step = 0.05 if gone is not None else max(0.0, until_s - time.monotonic())
        while not h.decided.wait(min(step, max(0.0, until_s - time.monotonic()))):
            if time.monotonic() >= until_s or (gone is not None and gone()):
                if self.cancel(h.info.request_id):
                    return None
                h.decided.wait()  # decided meanwhile: that stands
                break
        return h.action

    def cancel(self, request_id: str) -> bool:
        """Take a request out of its queue; False when it was decided already."""
        with self._lock:
            h = self._holds.pop(request_id, None)
            if h is None:
                return False
            q = self.queues.get(h.info.tier)
            if q is not None:
                q.remove(request_id)
        self._wake.set()  # the next in line may go now
        return True

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.tick_s)
            self._wake.clear()
            with self._lock:
                if not self._holds:
                    self._thread = None
                    return
            try:
                self._pass()
            except Exception:  # a failed pass is retried at the next tick
                log.exception("releasing held requests failed; trying again")

    def _pass(self) -> None:
        """Ask the policy until it has nothing to release; one dispatch at a time."""
        while True:
            with self._lock:
                if not self._holds:
                    return
                act = self._release(self.queues, time.time())
                if act is None:
                    return
                h = self._holds.pop(act.request_id, None)
                q = self.queues.get(act.tier)
                if q is not None:
                    q.remove(act.request_id)
            if h is None:  # the policy named a request this pen does not hold
                log.warning("admission released %s, which is not held here", act.request_id)
                return
            h.action = act
            h.decided.set()
            if act.kind == DISPATCH:
                h.booked.wait(self.book_wait_s)
