"""One Celery broker per datacenter: where a task for a queue is published.

Why: in a multi-region deployment each datacenter's workers consume from a
broker in their own datacenter, so a worker's BRPOP never crosses the WAN and a
datacenter keeps working when the link to another one is slow or down. The API
(and a worker re-sending a request to another datacenter) publishes each task
to the broker of the queue's datacenter; queue names start with it
(:mod:`tokenfleet.live.queues`). Datacenters without an entry in
``LiveConfig.dc_broker_urls`` use the process's default broker, so a one-broker
set-up is the empty mapping and nothing changes.

A datacenter whose broker refused a publish, or did not answer the background
probe, is *down* for ``broker_down_s``: FleetMind leaves it out, so its requests
spill where residency allows instead of failing one by one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

log = logging.getLogger("tokenfleet.brokers")


def parse_dc_broker_urls(text: str) -> dict[str, str]:
    """``"dc-a=redis://h:6379/0,dc-b=amqp://..."`` -> {dc: url}; "" -> {}."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        dc, sep, url = part.partition("=")
        dc, url = dc.strip(), url.strip()
        if not sep or not dc or not url or "." in dc:
            raise ValueError(
                f"dc_broker_urls entry '{part}' must be DC=URL (a datacenter name "
                "without dots, then its broker URL), entries separated by commas"
            )
        if dc in out:
            raise ValueError(f"dc_broker_urls names datacenter '{dc}' twice")
        out[dc] = url
    return out


def dc_of_queue(queue: str) -> str:
    """The datacenter a request queue belongs to (its first dotted part)."""
    return queue.split(".", 1)[0]


class DcBrokers:
    """The Celery apps one process publishes with, by datacenter.

    ``make_app(url)`` builds a publishing app for a broker URL (the API's
    ``create_celery``); apps are made on first use and kept.
    """

    def __init__(
        self,
        default: Any,
        urls: Mapping[str, str],
        make_app: Callable[[str], Any],
        *,
        down_for_s: float = 5.0,
        probe_period_s: float = 1.0,
    ) -> None:
        self.default = default
        self.urls = dict(urls)
        self.make_app = make_app
        self.down_for_s = down_for_s
        self.probe_period_s = probe_period_s
        self._apps: dict[str, Any] = {}
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pingers: dict[str, redis.Redis] = {}

    def own(self, dc: str) -> bool:
        """True when ``dc`` has a broker of its own (not the default one)."""
        return dc in self.urls

    def app_for(self, dc: str) -> Any:
        if dc not in self.urls:
            return self.default
        with self._lock:
            app = self._apps.get(dc)
            if app is None:
                app = self._apps[dc] = self.make_app(self.urls[dc])
            return app

    def send_task(self, name: str, *args: Any, queue: str, **kwargs: Any) -> Any:
        """Celery's ``send_task``, on the broker of ``queue``'s datacenter."""
        return self.app_for(dc_of_queue(queue)).send_task(name, *args, queue=queue, **kwargs)

    # -- health -----------------------------------------------------------------------
    def mark_down(self, dc: str, why: str, now_s: float | None = None) -> None:
        if dc not in self.urls:
            return  # the default broker's outage is everyone's: 503, as without DCs
        until = (time.time() if now_s is None else now_s) + self.down_for_s
        with self._lock:
            was = self._down_until.get(dc, 0.0)
            self._down_until[dc] = max(was, until)
        if was < until - self.down_for_s:
            log.warning("broker of %s is down (%s): its requests spill elsewhere", dc, why)

    def down(self, dc: str, now_s: float) -> bool:
        return self._down_until.get(dc, 0.0) > now_s

    def down_dcs(self, now_s: float) -> set[str]:
        return {dc for dc, until in self._down_until.items() if until > now_s}

    def probe(self) -> None:
        """Ask each datacenter broker whether it answers (one connection attempt)."""
        for dc, url in self.urls.items():
            try:
                self._ping(dc, url)
            except Exception as exc:  # noqa: BLE001 - any failure means: do not send there
                self.mark_down(dc, f"probe: {exc.__class__.__name__}")
            else:
                with self._lock:
                    if self._down_until.pop(dc, 0.0) > time.time():
                        log.warning("broker of %s answers again", dc)

    def _ping(self, dc: str, url: str) -> None:
        if url.startswith(("redis://", "rediss://", "unix://")):
            # kombu's Redis transport connects lazily: ask the server itself
            client = self._pingers.get(dc)
            if client is None:
                client = self._pingers[dc] = redis.Redis.from_url(
                    url, socket_timeout=1.0, socket_connect_timeout=1.0
                )
            client.ping()
            return
        with self.app_for(dc).connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=1.0)

    def start(self) -> None:
        """Probe in a daemon thread every ``probe_period_s`` (only with DC brokers)."""
        if not self.urls or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.probe_period_s):
                self.probe()

        self._thread = threading.Thread(target=loop, name="dc-brokers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        for app in list(self._apps.values()):
            try:
                app.close()
            except Exception:  # noqa: BLE001 - closing at shutdown: nothing to do
                pass
