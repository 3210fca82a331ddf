"""Full garbage collections when the API process is quiet, not when a counter says.

A full collection holds the interpreter while it walks every tracked object
of the process; with 2,000 streams open that took 390-400 ms on the 2-core
development machine, and ``/health`` waited that long (the stall watch's
log, docs/benchmarks.md "Holding 2,000 streams"). The API's own requests no
longer leave reference cycles (a test checks the streamed path), so its
garbage is freed by reference counting or, for a library's short-lived
cycles, by the young collections. The full collection is then only a
safety net, and it can wait for a moment with few requests in flight:

* automatic full collections are off (the oldest generation's threshold is
  out of reach); the young generations collect as before;
* a thread collects fully when at least ``every_s`` passed since the last
  full collection and at most ``quiet_at`` requests are in flight;
* and after ``at_most_s`` regardless, so that a process that is never quiet
  still frees what cycles it holds.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("tokenfleet.api")

#: the oldest generation's threshold while the collector runs: never reached
NEVER = 2**31 - 1
#: objects allocated (net) between young collections in a long-lived service
#: process (Python's default is 700), and the young collections between older ones
SERVICE_GC_THRESHOLDS = (50_000, 20, 100)


def space_collections() -> None:
    """For a process that holds thousands of requests on threads (the API, a
    worker): take what start-up built out of every collection (``gc.freeze``)
    and collect young objects every 50,000 allocations instead of 700. At
    Python's default a worker holding 1,000 streams ran full collections of
    up to 1.2 s on the 2-core machine, and its leases lapsed meanwhile."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVICE_GC_THRESHOLDS)


class QuietCollector:
    """Runs the process's full collections at quiet moments (see module doc)."""

    def __init__(
        self,
        busy: Callable[[], int],
        *,
        quiet_at: int = 64,
        every_s: float = 60.0,
        at_most_s: float = 900.0,
        check_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.busy = busy
        self.quiet_at = quiet_at
        self.every_s = every_s
        self.at_most_s = at_most_s
        self.check_s = check_s
        self.clock = clock
        self.last_s = clock()
        #: full collections run, and the objects they freed
        self.runs = 0
        self.freed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thresholds: tuple[int, int, int] | None = None

    def due(self) -> bool:
        """A full collection should run now."""
        since_s = self.clock() - self.last_s
        if since_s >= self.at_most_s:
            return True
        return since_s >= self.every_s and self.busy() <= self.quiet_at

    def collect_if_due(self) -> bool:
        if not self.due():
            return False
        t0 = time.perf_counter()
        freed = gc.collect()
        took_ms = (time.perf_counter() - t0) * 1000
        self.last_s = self.clock()
        self.runs += 1
        self.freed += freed
        log.debug("full collection at a quiet moment: %d freed in %.0f ms", freed, took_ms)
        return True

    def start(self) -> QuietCollector:
        self._thresholds = gc.get_threshold()
        young, middle, _ = self._thresholds
        gc.set_threshold(young, middle, NEVER)
        self._thread = threading.Thread(target=self._loop, name="quiet-gc", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)

    def _loop(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                self.collect_if_due()
            except Exception:
                log.exception("quiet collection failed")
