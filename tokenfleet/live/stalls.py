"""Say when the process stopped answering, and why, in its own log.

A ``/health`` probe is late when the interpreter could not run its thread:
a long garbage collection (which holds the interpreter throughout) or many
threads wanting the interpreter at once. A sampling profiler cannot attach
to a process with thousands of threads, so the process watches itself:

* a collector callback times every collection and logs those of at least
  ``threshold_ms`` (generation, objects examined, collected);
* a watch thread sleeps ``tick_s`` at a time and logs a wake-up late by at
  least ``threshold_ms``: the interpreter (or the host) held every thread
  back that long.

Both cost next to nothing when nothing is slow (one callback per
collection, ``1 / tick_s`` wake-ups a second), so the API runs them by
default (``api_stall_log_ms``).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

log = logging.getLogger("tokenfleet.stalls")

#: how often the watch thread wakes (seconds)
TICK_S = 0.02


class StallWatch:
    """Logs collections and interpreter stalls of at least ``threshold_ms``."""

    def __init__(self, threshold_ms: float, tick_s: float = TICK_S) -> None:
        self.threshold_s = threshold_ms / 1000.0
        self.tick_s = tick_s
        self._gc_started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: (monotonic time, seconds) of every logged stall, newest last (bounded)
        self.stalls: list[tuple[float, float]] = []
        self.collections: list[tuple[float, int, float]] = []

    def start(self) -> StallWatch:
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_started = now
            return
        took_s = now - self._gc_started
        if took_s >= self.threshold_s:
            gen = int(info.get("generation", -1))
            self._keep(self.collections, (time.monotonic(), gen, took_s))
            log.warning(
                "garbage collection of generation %d held the interpreter %.0f ms "
                "(%d collected, %d uncollectable)",
                gen,
                took_s * 1000,
                info.get("collected", 0),
                info.get("uncollectable", 0),
            )

    def _watch(self) -> None:
        while True:
            t0 = time.monotonic()
            if self._stop.wait(self.tick_s):
                return
            late_s = time.monotonic() - t0 - self.tick_s
            if late_s >= self.threshold_s:
                self._keep(self.stalls, (time.monotonic(), late_s))
                log.warning(
                    "the process stalled %.0f ms (a thread woke that late; %d threads)",
                    late_s * 1000,
                    threading.active_count(),
                )

    @staticmethod
    def _keep(into: list[Any], item: Any, limit: int = 1000) -> None:
        into.append(item)
        if len(into) > limit:
            del into[: len(into) - limit]
