"""The gateway's copy of the live state, kept fresh off the request path.

Two background threads per API process: one tails the KV event stream (fed by
every worker) into the router and the local prefix index, so every API replica
sees the same cache knowledge; the other re-reads the registered instances,
the shared dispatch accounting, the broker queue depths, beat's admission
knobs and FleetMind's spill shares at the periods below. The request path
reads these copies and falls back to an inline read, at twice the age, when
the thread lags or Redis was down.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import redis

from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.types import KVEvent
from tokenfleet.live.accounting import AccountingView
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.queues import DEFAULT_SHARES
from tokenfleet.live.state import InstanceInfo, LiveState, PendingRead

log = logging.getLogger("tokenfleet.api")

#: how often the registered instances are re-read from Redis: twice a scrape
#: period (0.5 s by default), not five times (what a re-read can find changes
#: at a scrape; a worker marking its instance unhealthy is seen within this)
INSTANCES_REFRESH_S = 0.25
#: admission reads the broker queue depths from Redis at most this often
QUEUE_DEPTHS_MAX_AGE_S = 0.05
#: beat's admission knobs and FleetMind spill shares are re-read this often
KNOBS_REFRESH_S = 1.0
#: an API replica that has not written its heartbeat for this long is gone
PEER_APIS_FRESH_S = 3.0
#: every instance's dispatch accounting is re-read this often (AccountingView)
ACCOUNTING_REFRESH_S = 0.02
#: the accounting and the queue depths are polled only while a request read them
#: within this many of their periods. Polled regardless, they were about 90 Redis
#: round trips a second (9 API CPU-ms per request at 5 req/s); a request after a
#: quieter spell reads them inline, as it did before the thread kept them.
POLL_WHILE_USED_PERIODS = 2
#: a request's prefetch (:meth:`LiveView.prefetch`) reads when a copy would be
#: this close to its age limit: dispatch comes a few ms after arrival
PREFETCH_MARGIN_S = 0.01
#: a prefetch nobody read after this long is read by the refresh thread
ABANDONED_PREFETCH_S = 1.0


class LiveView:
    """Part of :class:`~tokenfleet.live.gateway.Gateway`: what it reads from Redis."""

    state: LiveState
    live: LiveConfig
    router: Any
    router_lock: threading.Lock
    admission: Any
    dc_selector: Any
    _depths_copy: dict[str, int]
    tier_shares: dict[str, float]

    def _start_view(self) -> None:
        self.index = PrefixIndex(stride_blocks=1)
        self.index_lock = threading.Lock()
        self._infos: list[InstanceInfo] = []
        self._infos_at = 0.0
        #: monotonic time of the last Redis failure this process saw (0: none)
        self._redis_failed_at = 0.0
        self._infos_lock = threading.Lock()
        self._knobs_at = 0.0
        self._plan_at = 0.0
        self._depths = {}
        self._depths_at = -1.0
        self._depths_used_at = float("-inf")
        self.accounting = AccountingView(self.state.accounting, ACCOUNTING_REFRESH_S)
        #: this API process, among the replicas sharing the Redis (direct calls too)
        self.api_id = uuid.uuid4().hex[:12]
        #: how many other API replicas wrote their heartbeat lately (booking check)
        self.peer_apis = 0
        self._stop = threading.Event()
        #: wakes the refresh thread early (a prefetch, or close)
        self._kick = threading.Event()
        self._prefetch_lock = threading.Lock()
        #: the reads a request's prefetch wrote, not read yet (None: none)
        self._pending: PendingRead | None = None
        self._kv_thread = threading.Thread(target=self._kv_loop, name="kv-index", daemon=True)
        self._kv_thread.start()
        self._refresh_thread = threading.Thread(
            target=self._refresh_loop, name="refresh", daemon=True
        )
        self._refresh_thread.start()

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        self._kv_thread.join(timeout=2.0)
        self._refresh_thread.join(timeout=2.0)

    @property
    def _depths(self) -> dict[str, int]:
        """Broker queue depths as of ``_depths_at``; reading them marks them used,
        so the refresh thread keeps polling them (the dispatch reads this)."""
        self._depths_used_at = time.monotonic()
        return self._depths_copy

    @_depths.setter
    def _depths(self, value: dict[str, int]) -> None:
        self._depths_copy = value

    # -- shared prefix index ----------------------------------------------------------
    def _kv_loop(self) -> None:
        """Tail the KV event stream (fed by every worker) into the router and
        the local index, so every API replica sees the same cache knowledge."""
        last = "0-0"
        while not self._stop.is_set():
            try:
                last, events = self.state.read_kv_events(last, block_ms=500)
            except (redis.ConnectionError, redis.TimeoutError):
                self._stop.wait(0.5)
                continue
            except Exception:
                log.exception("KV event stream read failed")
                self._stop.wait(1.0)
                continue
            if events:
                self.apply_kv_events(events)

    def apply_kv_events(self, events: list[KVEvent]) -> None:
        with self.index_lock:
            for ev in events:
                self.index.apply(ev)
        with self.router_lock:
            for ev in events:
                self.router.on_kv_event(ev)

    # -- live topology ----------------------------------------------------------------
    def instances(self, max_age_s: float = 2 * INSTANCES_REFRESH_S) -> list[InstanceInfo]:
        """Registered instances, as of at most ``max_age_s`` ago (the refresh
        thread keeps them fresh; reading here is the fallback when it lags)."""
        now = time.monotonic()
        with self._infos_lock:
            if now - self._infos_at <= max_age_s:
                return self._infos
        return self._refresh_instances()

    def _refresh_instances(self) -> list[InstanceInfo]:
        now = time.monotonic()
        infos = self.state.instances()
        with self._infos_lock:
            if now >= self._infos_at:
                self._infos, self._infos_at = infos, now
        return infos

    def _refresh_loop(self) -> None:
        """Keep what routing and admission read from Redis fresh, off the request
        path: each of these reads is a round trip a request would otherwise pay
        whenever its copy aged out (the dispatch accounting: on every request).
        The request path still reads inline, at twice the age, if this thread
        falls behind or Redis was down."""
        due = {"instances": 0.0, "accounting": 0.0, "depths": 0.0, "knobs": 0.0}
        depths_period_s = QUEUE_DEPTHS_MAX_AGE_S / 2
        while True:
            # sleep until the next read is due (not 10 ms ticks: 100 wake-ups a
            # second) or a request asks for a prefetch
            self._kick.wait(max(0.001, min(due.values()) - time.monotonic()))
            if self._stop.is_set():
                return
            self._kick.clear()
            self._land_abandoned()
            now = time.monotonic()
            try:
                if now >= due["instances"]:
                    due["instances"] = now + INSTANCES_REFRESH_S
                    self._refresh_instances()
                # Unused, the accounting and the depths are looked at again only
                # with the instances: waking every 20-25 ms to find them unused
                # was 90 wake-ups a second, most of an idle API's CPU
                # (docs/benchmarks.md, section 28). A request meanwhile reads
                # them itself (prefetch) and polling resumes at the next look.
                if now >= due["accounting"]:
                    used = self.accounting.refresh_if_used(
                        [i.instance_id for i in self.instances()],
                        within_s=POLL_WHILE_USED_PERIODS * ACCOUNTING_REFRESH_S,
                    )
                    due["accounting"] = now + (
                        ACCOUNTING_REFRESH_S if used else INSTANCES_REFRESH_S
                    )
                if now >= due["depths"]:
                    # read by admission, and by the pinning and express checks
                    used = now - self._depths_used_at <= POLL_WHILE_USED_PERIODS * depths_period_s
                    if used:
                        self._refresh_depths()
                    due["depths"] = now + (depths_period_s if used else INSTANCES_REFRESH_S)
                if now >= due["knobs"]:
                    due["knobs"] = now + KNOBS_REFRESH_S / 2
                    self._refresh_admission_knobs(max_age_s=0.0)
                    self._refresh_fleet_plan(max_age_s=0.0)
                    if self.live.express_dispatch:
                        got = self.state.shares()
                        self.tier_shares = {**DEFAULT_SHARES, **got} if got else self.tier_shares
                    self.peer_apis = self.state.api_heartbeat(
                        self.api_id, time.time(), PEER_APIS_FRESH_S
                    )
            except redis.RedisError:
                self.redis_failed()
                continue  # requests see the outage themselves
            except Exception:
                log.exception("live-state refresh failed")

    # -- a request's reads, ahead of its dispatch ----------------------------------
    def prefetch(self) -> None:
        """A request arrived: if its dispatch would read the accounting or the
        queue depths inline (the refresh thread stops polling them while
        requests are rare, :data:`POLL_WHILE_USED_PERIODS`), write both reads
        to Redis now, on this thread, and let the dispatch read the replies
        (:meth:`await_prefetch`): Redis answers while this request is parsed,
        tokenized and hashed. At low load those two inline reads were about
        1 ms of the request's time to first token (docs/benchmarks.md,
        section 12); handing the read to the refresh thread still left a
        wait of a thread hand-off and the GIL (section 25)."""
        depths_left_s = QUEUE_DEPTHS_MAX_AGE_S - (time.monotonic() - self._depths_at)
        if min(self.accounting.fresh_for_s(), depths_left_s) > PREFETCH_MARGIN_S:
            return
        with self._prefetch_lock:
            pending = self._pending
            if pending is not None and time.monotonic() - pending.sent_at <= PREFETCH_MARGIN_S:
                return  # one is under way, and recent
            try:
                self._pending = self.state.send_accounting_and_queued(
                    i.instance_id for i in self.instances()
                )
            except redis.RedisError:
                self._pending = None  # the dispatch reads inline, and sees the outage
        if pending is not None:
            self._land(pending)  # an older one nobody read: its connection goes back

    def await_prefetch(self) -> None:
        """Dispatch: read the replies of the reads :meth:`prefetch` wrote (if
        another request's are still unread, those: they are as recent)."""
        with self._prefetch_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._land(pending)

    def _land(self, pending: PendingRead) -> None:
        try:
            accts, queued = pending.result()
        except redis.RedisError:
            return  # the dispatch reads inline, and sees the outage itself
        except Exception:
            log.exception("prefetch failed")  # the dispatch reads inline
            return
        self.accounting.refresh(pending.ids, read=lambda _ids: accts, began=pending.sent_at)
        if pending.sent_at >= self._depths_at:
            self._depths_copy, self._depths_at = queued, pending.sent_at

    def _land_abandoned(self) -> None:
        """The refresh thread: a prefetch whose request never dispatched (refused
        while parsing) still holds a pooled connection; read it."""
        with self._prefetch_lock:
            pending = self._pending
            if pending is None or time.monotonic() - pending.sent_at < ABANDONED_PREFETCH_S:
                return
            self._pending = None
        self._land(pending)

    def redis_failed(self) -> None:
        """A Redis call of this process failed: ``/health`` stops trusting the
        instances' copy until a later read succeeds."""
        with self._infos_lock:
            self._redis_failed_at = time.monotonic()

    def live_instances(self) -> list[InstanceInfo]:
        now = time.time()
        return [i for i in self.instances() if i.is_live(now, self.live.stale_after_s)]

    def models(self) -> dict[str, int]:
        """Served model -> largest context length among live instances."""
        out: dict[str, int] = {}
        for i in self.live_instances():
            out[i.model] = max(out.get(i.model, 0), i.max_model_len_tokens)
        return out

    # -- policy knobs written by beat ---------------------------------------------------
    def _refresh_admission_knobs(self, max_age_s: float = KNOBS_REFRESH_S) -> None:
        if self.admission is None:
            return
        now = time.monotonic()
        if now - self._knobs_at < max_age_s:
            return
        self._knobs_at = now
        try:
            thr = self.state.thresholds()
        except redis.RedisError:
            return
        for knob in ("batch_share", "long_share", "reject_factor"):
            v = thr.get(knob)
            if v is not None and hasattr(self.admission, knob):
                setattr(self.admission, knob, v)
        measured = thr.get("lane_measured")
        if measured is not None and hasattr(self.admission, "lane_measured"):
            self.admission.lane_measured = measured > 0

    def _refresh_depths(self) -> None:
        now = time.monotonic()
        depths = self.state.queued()
        self._depths_copy, self._depths_at = depths, now

    def _refresh_fleet_plan(self, max_age_s: float = KNOBS_REFRESH_S) -> None:
        """The long cycle's spill shares (beat writes them to Redis)."""
        now = time.monotonic()
        if self.dc_selector is None or now - self._plan_at < max_age_s:
            return
        self._plan_at = now
        try:
            shares = self.state.spill_shares()
        except redis.RedisError:
            return
        self.dc_selector.spill_share = shares
