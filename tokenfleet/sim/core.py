"""A minimal SimPy-style event loop: one heap, one clock, deterministic.

Events are ``(time, priority, seq, callback, args)`` tuples. ``seq`` breaks
ties in insertion order, so a run is a pure function of its inputs and seed.
Callbacks instead of generator processes keep the hot path cheap: the
simulator schedules millions of engine steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

URGENT = 0  # e.g. engine step completions: state must settle first
NORMAL = 1  # arrivals, scrapes, control ticks


class Environment:
    """Owns simulated time. ``now`` only moves forward, inside ``run``."""

    def __init__(self, initial_time_s: float = 0.0) -> None:
        self.now = initial_time_s
        self._heap: list[tuple[float, int, int, Callable[..., object], tuple[Any, ...]]] = []
        self._seq = 0
        self.events_processed = 0
        self._stopped = False

    def schedule(
        self, delay_s: float, callback: Callable[..., object], *args: Any, priority: int = NORMAL
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"negative delay {delay_s}")
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay_s, priority, self._seq, callback, args))

    def schedule_at(
        self, time_s: float, callback: Callable[..., object], *args: Any, priority: int = NORMAL
    ) -> None:
        self.schedule(max(0.0, time_s - self.now), callback, *args, priority=priority)

    def peek(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def stop(self) -> None:
        self._stopped = True

    def run(self, until_s: float | None = None) -> None:
        heap = self._heap
        pop = heapq.heappop
        limit = float("inf") if until_s is None else until_s
        self._stopped = False
        n = 0
        while heap and not self._stopped:
            if heap[0][0] > limit:
                self.now = limit
                break
            t, _, _, cb, args = pop(heap)
            self.now = t
            cb(*args)
            n += 1
        self.events_processed += n
