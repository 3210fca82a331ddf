"""Celery's threads pool, plus a wake-up of the event loop when a task ends.

Why threads: a request task spends its time waiting on the engine's stream
and on Redis, so it is I/O-bound. Celery's concurrency guide ("Concurrency >
Overview of Concurrency Options", docs.celeryq.dev/en/stable/userguide/
concurrency/) recommends ``prefork`` for CPU-bound work; it would also hand
every message to a child process over a pipe (one more hop and a pickling of
the whole prompt on the time-to-first-token path) and cap the requests a
worker streams at once to its process count. ``solo`` runs one task at a time
in the consumer's own thread, which cannot stream ``--slots`` requests at once.
``threads`` runs each task on a ``concurrent.futures`` thread of the worker
process: no extra hop, ``concurrency = slots`` streams.

With ``task_acks_late`` the message is acknowledged from the pool thread
after the task returns. Celery's threads pool never tells the worker's event
loop about it, so on Redis (where a new ``BRPOP`` is only issued when the
loop runs and QoS has room) the freed slot sat unused until the loop's 1 s
poll timeout: up to a second of added queueing per request. This subclass
wakes the loop (``hub.call_soon`` writes to its waker pipe) right after the
acknowledgement, so the next message is fetched at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.concurrency.thread import TaskPool


def _noop() -> None:
    return None


class WakingThreadPool(TaskPool):
    hub: Any = None

    def register_with_event_loop(self, loop: Any) -> None:
        self.hub = loop
        super().register_with_event_loop(loop)

    def on_apply(
        self,
        target: Callable[..., Any],
        args: Any = None,
        kwargs: Any = None,
        callback: Callable[..., Any] | None = None,
        accept_callback: Callable[..., Any] | None = None,
        **options: Any,
    ) -> Any:
        if callback is not None:
            inner = callback

            def callback(*a: Any, **kw: Any) -> Any:
                try:
                    return inner(*a, **kw)
                finally:
                    hub = self.hub
                    if hub is not None:
                        hub.call_soon(_noop)

        return super().on_apply(target, args, kwargs, callback, accept_callback, **options)
