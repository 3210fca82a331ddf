"""An API replica's view of every instance's dispatch accounting.

The accounting lives in Redis, where the API replicas (dispatches to an
affinity queue) and the workers (claims from a pool queue, first tokens,
finishes) update it. Reading it on every request put a round trip on the
time-to-first-token path. This view holds what Redis had at the last read,
which the gateway's refresh thread repeats every ``period_s``, plus this
replica's own writes since: a router sees its own dispatches at once (the
brief's "its own dispatch accounting") and everyone else's within one
period, while the engines' metrics it also weighs are scrape-old anyway.

A write whose Redis round trip ended before a read began is in that read,
so it leaves the pending list then. One that overlaps a read may be counted
twice until the next read: at most one period of one request's tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from tokenfleet.core.types import DispatchAccounting


class AccountingView:
    """Thread-safe; ``read`` is the Redis read (``LiveState.accounting``)."""

    def __init__(
        self,
        read: Callable[[list[str]], dict[str, DispatchAccounting]],
        period_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.period_s = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._base: dict[str, DispatchAccounting] = {}
        self._ids: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._used_at = float("-inf")
        #: (when its round trip ended, instance, field deltas) of our own writes
        self._pending: list[tuple[float, str, Mapping[str, int]]] = []

    def refresh(
        self,
        instance_ids: Iterable[str],
        read: Callable[[list[str]], dict[str, DispatchAccounting]] | None = None,
        began: float | None = None,
    ) -> None:
        """Read Redis now (with ``read``: a read that fetches more in the same
        round trip; with ``began``, the time a read ``read`` returns the
        result of was sent, :meth:`LiveView.prefetch`)."""
        ids = list(instance_ids)
        if began is None:
            began = self._clock()
        got = (read or self._read)(ids)
        with self._lock:
            if began < self._read_at:
                return  # a newer read already landed
            self._base, self._ids, self._read_at = got, frozenset(ids), began
            self._pending = [p for p in self._pending if p[0] >= began]

    def refresh_if_used(self, instance_ids: Iterable[str], within_s: float = 1.0) -> bool:
        """The refresh thread's read: skipped while no request has looked for
        ``within_s`` (an idle API does not poll Redis 50 times a second; its
        next request reads inline). True if it read."""
        if self._clock() - self._used_at <= within_s:
            self.refresh(instance_ids)
            return True
        return False

    def fresh_for_s(self) -> float:
        """How much longer :meth:`get` answers without reading inline (<= 0: it would read)."""
        return self._read_at + 2 * self.period_s - self._clock()

    def wrote(self, instance_id: str, delta: Mapping[str, int]) -> None:
        """This replica's accounting write to ``instance_id`` just returned."""
        with self._lock:
            self._pending.append((self._clock(), instance_id, dict(delta)))

    def get(self, instance_ids: Iterable[str]) -> dict[str, DispatchAccounting]:
        """Every instance's accounting; reads Redis inline when the refresh
        thread has fallen two periods behind or new instances appeared."""
        ids = list(instance_ids)
        now = self._clock()
        with self._lock:
            self._used_at = now
            fresh = now - self._read_at <= 2 * self.period_s and self._ids.issuperset(ids)
        if not fresh:
            self.refresh(ids)
        with self._lock:
            out = {}
            for iid in ids:
                base = self._base.get(iid)
                out[iid] = replace(base) if base is not None else DispatchAccounting()
            for _at, iid, delta in self._pending:
                acct = out.get(iid)
                if acct is not None:
                    for name, d in delta.items():
                        setattr(acct, name, max(0, getattr(acct, name) + d))
            return out
