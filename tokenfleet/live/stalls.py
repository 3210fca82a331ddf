"""Say when the process stopped answering, and why, in its own log.

A ``/health`` probe is late when the interpreter could not run its thread:
a long garbage collection (which holds the interpreter throughout) or many
threads wanting the interpreter at once. A sampling profiler cannot attach
to a process with thousands of threads, so the process watches itself:

* a collector callback times every collection and logs those of at least
  ``threshold_ms`` (generation, objects examined, collected);
* a watch thread sleeps ``tick_s`` at a time (a quarter of the threshold)
  and logs a wake-up late by at least ``threshold_ms``, with the CPU the
  process used meanwhile: about as much as the stall when its own threads
  held the interpreter, little when the host did not run the process.

Both cost little when nothing is slow (one callback per collection,
``1 / tick_s`` wake-ups a second), so the API and the workers run them by
default (``api_stall_log_ms``, ``worker_stall_log_ms``).
"""

from __future__ import annotations

import gc
import logging
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import tokenfleet

log = logging.getLogger("tokenfleet.stalls")

#: how often the watch thread wakes (seconds): a quarter of the threshold,
#: within these bounds. Each timed wake-up costs the process about 50 us of
#: CPU here; at a fixed 20 ms that was 4-5 ms a second of an idle worker
#: (docs/benchmarks.md, section 17). A stall is measured as how late the
#: thread woke, which undercounts it by up to one tick.
MIN_TICK_S = 0.02
MAX_TICK_S = 0.1
#: a stall's log line names the busy threads' code at most this often (seconds)
DESCRIBE_EVERY_S = 1.0
#: a thread whose innermost frame is one of these waits, it does not compete
_IDLE_FUNCTIONS = frozenset(
    {
        "wait",
        "select",
        "poll",
        "accept",
        "readinto",
        "recv_into",
        "recv",
        "sleep",
        "_recv",
        "readline",
        "read",
        "acquire",
        "get",
        "_wait_for_tstate_lock",
        "serve_forever",
    }
)
#: a busy thread is named by its innermost frame outside these (the standard
#: library and the installed packages): the project's code that made it run
_LIBRARY_DIRS = tuple(
    sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
)

#: this project's packages (installed or not): tokenfleet, web and workers sit side by side
_ROOT = Path(tokenfleet.__file__ or ".").resolve().parent.parent
_PROJECT_DIRS = tuple(f"{_ROOT / name}/" for name in ("tokenfleet", "web", "workers"))


def _library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_DIRS) and not filename.startswith(_PROJECT_DIRS)


def describe_busy_threads(top: int = 5) -> str:
    """Where most threads that are not waiting run now, as ``file function x
    count`` (their innermost frame in this project's code), busiest first:
    after a stall, those are the threads that took the interpreter's turns."""
    counts: dict[str, int] = {}
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident == me or frame.f_code.co_name in _IDLE_FUNCTIONS:
            continue
        f: FrameType | None = frame
        while f is not None and _library(f.f_code.co_filename):
            f = f.f_back
        code = (frame if f is None else f).f_code
        key = f"{code.co_filename.rsplit('/', 1)[-1]} {code.co_name}"
        counts[key] = counts.get(key, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} x{n}" for k, n in ranked) or "none"


class StallWatch:
    """Logs collections and interpreter stalls of at least ``threshold_ms``."""

    def __init__(self, threshold_ms: float, tick_s: float | None = None) -> None:
        self.threshold_s = threshold_ms / 1000.0
        if tick_s is None:
            tick_s = min(MAX_TICK_S, max(MIN_TICK_S, self.threshold_s / 4))
        self.tick_s = tick_s
        self._gc_started = 0.0
        self._described_at = float("-inf")
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
            t0, cpu0 = time.monotonic(), time.process_time()
            if self._stop.wait(self.tick_s):
                return
            late_s = time.monotonic() - t0 - self.tick_s
            if late_s >= self.threshold_s:
                # CPU the process used meanwhile: about the stall's length when its
                # own threads held the interpreter; near zero when the host did not
                # run it (or it waited on something)
                cpu_s = time.process_time() - cpu0
                self._keep(self.stalls, (time.monotonic(), late_s))
                busy = ""
                if time.monotonic() - self._described_at >= DESCRIBE_EVERY_S:
                    self._described_at = time.monotonic()
                    busy = "; busy threads: " + describe_busy_threads()
                log.warning(
                    "the process stalled %.0f ms (a thread woke that late; the process "
                    "used %.0f ms of CPU meanwhile; %d threads%s)",
                    late_s * 1000,
                    cpu_s * 1000,
                    threading.active_count(),
                    busy,
                )

    @staticmethod
    def _keep(into: list[Any], item: Any, limit: int = 1000) -> None:
        into.append(item)
        if len(into) > limit:
            del into[: len(into) - limit]
