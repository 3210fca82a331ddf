"""CPU seconds from Linux ``/proc`` stat files, for a thread or a process.

One parser for what the API's per-thread metric
(:class:`web.metrics.ThreadCpuCollector`) and the benchmarks read.
"""

from __future__ import annotations

import os

#: seconds per clock tick of ``/proc`` times
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def stat_cpu_s(path: str) -> float | None:
    """User + system CPU seconds in a ``/proc/.../stat`` file (a process's or a
    thread's, ``/proc/self/task/<tid>/stat``); None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_S
