"""Per-process state of a worker that serves one engine instance (or a DC pool).

A worker process runs Celery's threads pool (one thread per request it may
run) plus three small threads of its own:

* the scraper: every ``scrape_interval_s`` reads the engine's ``/health`` and
  ``/metrics`` and writes the instance snapshot (with its age) to Redis; an
  engine that stops answering is marked unhealthy there and its requests
  that have no first token yet are aborted and re-sent elsewhere;
* the watchdog: renews the leases of running requests, and aborts the
  engine call of any request the client cancelled;
* the tier gate: decides which of the worker's queues it consumes, so it
  pulls a tier only when its engine has capacity for that tier (SLOMax share
  of its slots) and lower tiers yield while higher ones have work queued.

Optionally a fourth relays the engine's vLLM KV events (ZeroMQ) into the
shared prefix-index stream in Redis.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import ScrapedMetrics
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.queues import (
    DEFAULT_SHARES,
    TIER_PRIORITY,
    is_pool_queue,
    tier_of_queue,
    worker_queues,
)
from tokenfleet.live.relay import RelayHub
from tokenfleet.live.scrape import Scraper
from tokenfleet.live.state import InstanceInfo, LiveState
from workers.api_watch import ApiWatch

log = logging.getLogger("tokenfleet.worker")

#: the watchdog looks for cancelled requests this often (seconds): a Redis round
#: trip per tick while requests run, so 10 a second at 0.1 s for a reaction the
#: client does not see (on the direct path the API closes the engine call itself)
WATCHDOG_TICK_S = 0.25
#: the tier gate's pass while it polls (no gate channel, or RabbitMQ's queue depths)
GATE_POLL_S = 0.05
#: the tier gate's pass when every change it decides by wakes it
#: (:meth:`WorkerRuntime._gate_period_s`)
GATE_IDLE_S = 0.5


class Abortable(Protocol):
    """What a flight's watchdog and scraper stop: the engine call, or on the
    direct path the wait for the API's outcome."""

    def abort(self, reason: str) -> None: ...

    @property
    def aborted(self) -> str | None: ...


@dataclass(slots=True)
class RequestInFlight:
    """One request this worker is running."""

    request_id: str
    tier: str
    attempt: int
    call: Abortable | None = None
    first_token: bool = False
    started_at: float = field(default_factory=time.time)
    prefill_tokens: int = 0  # uncached prompt tokens (the router's estimate)


class WorkerRuntime:
    def __init__(
        self,
        live: LiveConfig,
        state: LiveState,
        info: InstanceInfo,
        *,
        ledger: Any = None,
        slo: SLOConfig | None = None,
        pool_mode: bool = False,
        kv_events_endpoint: str | None = None,
        send_task: Callable[..., Any] | None = None,
        public_engine_url: str = "",
    ) -> None:
        self.live = live
        self.state = state
        self.info = info
        self.ledger = ledger
        self.slo = slo or SLOConfig()
        self.pool_mode = pool_mode
        self.kv_events_endpoint = kv_events_endpoint
        self.send_task = send_task
        #: the engine's URL the API calls on the direct path (go entry)
        self.public_engine_url = public_engine_url or info.url
        # registered, so an API can run an attempt here itself (express dispatch)
        info.api_url = self.public_engine_url if self.public_engine_url != info.url else ""
        info.exact_kv = bool(kv_events_endpoint)
        #: the broker orders queues itself (Redis with queue_order_strategy=priority);
        #: else lower tiers must pause while a higher one has work queued
        self.broker_orders_queues = False
        #: exact queue depths when the broker can tell them cheaply (Redis: LLEN)
        self.queue_depths: Callable[[list[str]], dict[str, int]] | None = None
        self.worker_id = f"{info.instance_id}:{uuid.uuid4().hex[:8]}"
        self.queues = worker_queues(
            info.dc, None if pool_mode else info.instance_id, pool=info.role != "prefill"
        )
        self.scraper = Scraper(info.url, timeout_s=max(0.5, live.scrape_interval_s))
        self.engine_healthy = True
        self.engine_unhealthy_reason = ""
        self.consecutive_failures = 0
        self.unhealthy_until = 0.0
        self._flights: dict[str, RequestInFlight] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._consumer: Any = None
        #: queues this connection's consumer declared (re-added without declaring)
        self._declared: set[str] = set()
        self._shares: dict[str, float] = dict(DEFAULT_SHARES)
        self._shares_at = 0.0
        self.kv_events_relayed = 0
        #: task id -> when its message was received (Celery's task_received)
        self.received: dict[str, float] = {}
        #: task id -> tier, for messages received but not started yet
        self.reserved: dict[str, str] = {}
        #: task id -> prefill tokens of those messages (None: unknown, a full budget)
        self.reserved_prefill: dict[str, int | None] = {}
        #: wakes the tier gate at once (a first token or a finish may reopen queues)
        self.gate_kick = threading.Event()
        #: the gate's channel is subscribed (:meth:`_gate_listen_loop`)
        self._gate_listening = False
        self.exact_kv_events = False
        self._outcome_hub: RelayHub | None = None
        self._api_watch: ApiWatch | None = None
        #: the accounting read while this instance looked idle, and for how many
        #: scrapes in a row it stayed so (:meth:`_repair_accounting`)
        self._idle_acct: dict[bytes, bytes] | None = None
        self._idle_scrapes = 0
        #: uncached prompt tokens booked on this instance by anyone (the shared
        #: dispatch accounting): includes what the APIs run here themselves
        #: (express dispatch), which this worker's own flights do not show
        self.shared_prefill_tokens = 0

    def outcome_hub(self) -> RelayHub:
        """Reads the outcome streams of this process's direct requests
        (:mod:`tokenfleet.live.direct`): one thread and connection, not one
        blocked connection per waiting request; started at the first."""
        with self._lock:
            if self._outcome_hub is None:
                self._outcome_hub = RelayHub(self.state)
            return self._outcome_hub

    def api_watch(self) -> ApiWatch:
        """Watches the APIs this process's direct requests wait on (one thread
        for all of them, :mod:`workers.api_watch`); started at the first."""
        with self._lock:
            if self._api_watch is None:
                self._api_watch = ApiWatch(self.state, self.live.lease_ttl_s)
            return self._api_watch

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self.state.register_instance(self.info)
        self.scrape_once()
        for target, name in (
            (self._scrape_loop, "scraper"),
            (self._watchdog_loop, "watchdog"),
            (self._gate_loop, "tier-gate"),
            (self._gate_listen_loop, "gate-listen"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if self.kv_events_endpoint:
            t = threading.Thread(target=self._kv_loop, name="kv-events", daemon=True)
            t.start()
            self._threads.append(t)
            self.exact_kv_events = True

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)
        if self._outcome_hub is not None:
            self._outcome_hub.close()
        if self._api_watch is not None:
            self._api_watch.stop()
        if deregister:
            try:
                self.state.deregister_instance(self.info.instance_id)
            except Exception:  # noqa: BLE001 - Redis may be gone at shutdown
                pass
        self.scraper.close()

    def attach_consumer(self, consumer: Any) -> None:
        """Called by the consumer bootstep once Celery's task consumer runs
        (again after each reconnection, having declared the queues it consumes)."""
        self._consumer = consumer
        try:
            self._declared = {q.name for q in consumer.task_consumer.queues} if consumer else set()
        except Exception:  # noqa: BLE001 - declare on every re-add then
            self._declared = set()

    # -- flights --------------------------------------------------------------------
    def add_flight(self, flight: RequestInFlight, task_id: str | None = None) -> None:
        """``task_id``'s reservation becomes this flight in one step: between the
        two the tier gate would see a free slot and let one more message in."""
        with self._lock:
            if task_id is not None:
                self.reserved.pop(task_id, None)
                self.reserved_prefill.pop(task_id, None)
            self._flights[flight.request_id] = flight

    def remove_flight(self, rid: str) -> None:
        with self._lock:
            self._flights.pop(rid, None)
        self.gate_kick.set()

    def flights(self) -> list[RequestInFlight]:
        with self._lock:
            return list(self._flights.values())

    def running_by_tier(self, include_reserved: bool = False) -> dict[str, int]:
        out = {t: 0 for t in TIER_PRIORITY}
        for f in self.flights():
            out[f.tier] = out.get(f.tier, 0) + 1
        if include_reserved:
            with self._lock:
                for tier in self.reserved.values():
                    out[tier] = out.get(tier, 0) + 1
        return out

    # -- message receipt (runs in Celery's consumer thread) ---------------------------
    def on_received(self, task_id: str, queue: str, prefill_tokens: int | None = None) -> None:
        """Count the message against its tier at once and, if that fills the
        tier's share, stop consuming the tier right here: the consumer thread
        owns the consumer, and waiting for the gate thread would let a burst
        of messages in before it reacts."""
        tier = tier_of_queue(queue) if queue else ""
        if tier not in TIER_PRIORITY:
            tier = ""  # control tasks and the like: not an engine request
        with self._lock:
            self.received[task_id] = time.time()
            if tier:
                self.reserved[task_id] = tier
                self.reserved_prefill[task_id] = prefill_tokens
        if not tier or self._consumer is None:
            return
        if not self.pool_open():
            self._pause_soon(is_pool_queue, "prefill budget")
        slots = max(1, self.info.slots)
        cap = max(1, math.ceil(self.shares().get(tier, 1.0) * slots))
        if cap < slots and self.running_by_tier(include_reserved=True).get(tier, 0) >= cap:
            self._pause_soon(lambda q: tier_of_queue(q) == tier, f"tier {tier} share")

    # -- late binding: pool work only for an engine with free prefill capacity ---------
    def pending_prefill_tokens(self) -> int:
        """Uncached prompt tokens waiting for prefill here, counting messages
        received but not started by their header (a full budget if absent)."""
        budget = self.live.pool_prefill_budget_tokens
        with self._lock:
            flights = list(self._flights.values())
            reserved = [self.reserved_prefill.get(t) for t in self.reserved]
        own = sum(f.prefill_tokens for f in flights if not f.first_token) + sum(
            budget if n is None else n for n in reserved
        )
        return max(own, self.shared_prefill_tokens)

    def read_shared_prefill(self) -> None:
        """The gate thread's read of :attr:`shared_prefill_tokens` (one HGET)."""
        try:
            self.shared_prefill_tokens = max(
                0, self.state.prefill_pending_uncached(self.info.instance_id)
            )
        except Exception:  # noqa: BLE001 - Redis away: the worker's own count stands
            self.shared_prefill_tokens = 0

    def pool_open(self) -> bool:
        return self.pending_prefill_tokens() < self.live.pool_prefill_budget_tokens

    def _pause_soon(self, pred: Callable[[str], bool], why: str) -> None:
        """:meth:`_pause`, once the message being received is on its pool thread.

        Cancelling queues took ~0.4 ms of the consumer thread, and the message
        waited for it: a prompt that fills the prefill budget (8k tokens) paid
        it on its time to first token. Kombu's loop runs ``call_soon`` work
        before its next fetch is issued (``Hub.create_loop``: ready callbacks,
        then timers, then the tick that sends the next ``BRPOP``), so no
        message of the paused queues slips in between."""
        hub = getattr(self._consumer, "hub", None)
        if hub is None:
            self._pause(pred, why)
        else:
            hub.call_soon(self._pause, pred, why)

    def _pause(self, pred: Callable[[str], bool], why: str) -> None:
        """Stop consuming the matching queues now (consumer thread only)."""
        c = self._consumer
        try:
            for q in [q.name for q in c.task_consumer.queues]:
                if pred(q):
                    c.cancel_task_queue(q)
        except Exception:
            log.debug("could not pause queues (%s)", why, exc_info=True)

    def started(self, task_id: str) -> float | None:
        """The task left the pool's queue; returns when its message was received.
        Its reservation stays until it becomes a flight or the task ends."""
        with self._lock:
            return self.received.pop(task_id, None)

    def task_done(self, task_id: str) -> None:
        """The task returned: drop its reservation if no flight took it (a
        duplicate, a cancel, a retry) and let the gate reopen its tier."""
        with self._lock:
            held = self.reserved.pop(task_id, None)
            self.reserved_prefill.pop(task_id, None)
        if held is not None:
            self.gate_kick.set()

    # -- engine health ----------------------------------------------------------------
    def is_engine_healthy(self) -> bool:
        return self.engine_healthy and time.time() >= self.unhealthy_until

    def note_engine_failure(self, reason: str) -> None:
        """A failed call: after ``engine_fail_threshold`` in a row the instance is
        marked unhealthy for ``engine_unhealthy_s`` (routers then skip it)."""
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.live.engine_fail_threshold:
            self.unhealthy_until = time.time() + self.live.engine_unhealthy_s
            self.gate_kick.set()  # stop taking work for it now
            log.warning(
                "instance %s marked unhealthy for %.1fs: %s",
                self.info.instance_id,
                self.live.engine_unhealthy_s,
                reason,
            )
            try:
                self.state.mark_unhealthy(
                    self.info.instance_id, self.live.engine_unhealthy_s, reason
                )
                self.state.count(instances_marked_unhealthy=1)
            except Exception:
                log.exception("could not mark instance unhealthy in Redis")

    def note_engine_success(self) -> None:
        self.consecutive_failures = 0

    def scrape_once(self) -> None:
        res = self.scraper.scrape()
        was = self.engine_healthy
        self.engine_healthy = res.metrics.healthy
        self.engine_unhealthy_reason = res.error
        if was and not res.metrics.healthy:
            log.warning("engine %s unhealthy: %s", self.info.url, res.error)
            self._abort_unstarted(f"engine unhealthy: {res.error}")
            self.gate_kick.set()
        elif not was and res.metrics.healthy:
            log.info("engine %s healthy again", self.info.url)
            self.gate_kick.set()
        try:
            self.state.publish_snapshot(
                self.info.instance_id, res.metrics, self.running_by_tier(), info=self.info
            )
            self._repair_accounting(res.metrics)
        except Exception as exc:  # noqa: BLE001 - Redis blip: next round retries
            log.debug("snapshot not written: %r", exc)

    def _repair_accounting(self, m: ScrapedMetrics) -> None:
        """Clear dispatch accounting that nothing can release any more.

        Bookings are released by the worker that ran the request (and, for a
        disaggregated one, by its decode worker on the prefill instance); a
        worker killed mid-request never releases them, and routers then see
        that instance loaded for good. When the engine runs and queues
        nothing, this worker holds and awaits nothing, no message waits in
        this instance's queues, and the accounting stayed the same over
        ``ACCT_REPAIR_SCRAPES`` scrapes, what it books is gone: it is cleared,
        unless a booking lands meanwhile (:meth:`LiveState.clear_acct_if`)."""
        idle = (
            m.healthy
            and m.num_running == 0
            and m.num_waiting == 0
            and not self.flights()
            and not self.reserved
        )
        if idle:
            mine = [q for q in self.queues if not is_pool_queue(q)]
            queued = self.state.queued()
            idle = not any(queued.get(q, 0) for q in mine)
        seen = self.state.acct_raw(self.info.instance_id) if idle else {}
        # dispatched_total is a count, not load: a clear keeps it
        if not any(v not in (b"0", b"") for k, v in seen.items() if k != b"dispatched_total"):
            self._idle_acct, self._idle_scrapes = None, 0
            return
        if seen != self._idle_acct:
            self._idle_acct, self._idle_scrapes = seen, 1
            return
        self._idle_scrapes += 1
        if self._idle_scrapes >= ACCT_REPAIR_SCRAPES:
            if self.state.clear_acct_if(self.info.instance_id, seen):
                log.warning(
                    "instance %s: cleared dispatch accounting nothing releases (%s): a worker "
                    "lost mid-request",
                    self.info.instance_id,
                    ", ".join(f"{k.decode()}={v.decode()}" for k, v in sorted(seen.items())),
                )
            self._idle_acct, self._idle_scrapes = None, 0

    def _abort_unstarted(self, reason: str) -> None:
        for f in self.flights():
            if not f.first_token and f.call is not None:
                f.call.abort(reason)

    # -- loops ----------------------------------------------------------------------
    def _scrape_loop(self) -> None:
        interval = self.live.scrape_interval_s
        while not self._stop.wait(interval):
            self.scrape_once()

    def _watchdog_loop(self) -> None:
        renew_every = self.live.lease_ttl_s / 3.0
        next_renew = 0.0
        while not self._stop.wait(WATCHDOG_TICK_S):
            flights = self.flights()
            if not flights:
                continue
            rids = [f.request_id for f in flights]
            try:
                now = time.monotonic()
                if now >= next_renew:
                    self.state.renew_leases(rids, self.live.lease_ttl_s, self.worker_id)
                    next_renew = now + renew_every
                gone = self.state.cancelled(rids)
            except Exception as exc:  # noqa: BLE001
                log.debug("watchdog: Redis unavailable: %r", exc)
                continue
            for f in flights:
                if f.request_id in gone and f.call is not None and f.call.aborted is None:
                    f.call.abort("cancelled by client")

    def shares(self) -> dict[str, float]:
        now = time.monotonic()
        if now - self._shares_at > 1.0:
            self._shares_at = now
            try:
                got = self.state.shares()
                if got:
                    self._shares = {**DEFAULT_SHARES, **got}
            except Exception:  # noqa: BLE001
                pass
        return self._shares

    def desired_queues(self, queued: dict[str, int] | None = None) -> list[str]:
        """Queues to consume now, highest priority first.

        A tier is consumed while the engine is healthy and the tier runs fewer
        than ``share * slots`` requests. Where the broker does not order queues
        itself (RabbitMQ), a tier also pauses while any higher tier of this
        worker has requests queued (it yields); on Redis the priority poll order
        already gives every free slot to the highest tier waiting. The total
        is capped by Celery itself: concurrency = slots, prefetch multiplier 1.
        """
        if not self.is_engine_healthy():
            return []
        pool_ok = self.pool_open()
        slots = max(1, self.info.slots)
        running = self.running_by_tier(include_reserved=True)
        shares = self.shares()
        queued = queued or {}
        out: list[str] = []
        higher_waiting = False
        for tier in TIER_PRIORITY:
            tier_qs = [
                q
                for q in self.queues
                if tier_of_queue(q) == tier and (pool_ok or not is_pool_queue(q))
            ]
            cap = max(1, math.ceil(shares.get(tier, 1.0) * slots))
            # A cap of all slots needs no gate (Celery's concurrency is the cap),
            # and not cancelling keeps the broker's poll on every queue.
            if (cap >= slots or running.get(tier, 0) < cap) and not higher_waiting:
                out.extend(tier_qs)
            if not self.broker_orders_queues and any(queued.get(q, 0) > 0 for q in tier_qs):
                higher_waiting = True
        return out

    def _gate_period_s(self) -> float:
        """How long the gate sleeps between passes when nothing wakes it.

        Everything the gate decides by wakes it when it changes: this worker's
        flights and reservations (``gate_kick``), the engine's health, and the
        prefill other processes book on the instance (a message on its
        :meth:`~tokenfleet.live.state.LiveState.gate_channel`, read by
        :meth:`_gate_listen_loop`). The pass then only catches what has no
        wake-up (beat's shares, an unhealthy mark expiring): twice a second.
        Polling the accounting every 50 ms instead was a third of an idle
        worker's CPU (docs/benchmarks.md, section 24). Without the channel
        (not subscribed yet, Redis away) or where the gate needs the queue
        depths (a broker that does not order queues: RabbitMQ) it polls."""
        if self.broker_orders_queues and self._gate_listening:
            return GATE_IDLE_S
        return GATE_POLL_S

    def _gate_listen_loop(self) -> None:
        """Wake the gate when someone's booking moves this instance's prefill."""
        if self.info.role == "prefill":
            return  # it consumes no pool queues: nothing to gate by the prefill
        channel = self.state.gate_channel(self.info.instance_id)
        while not self._stop.is_set():
            pubsub = self.state.r.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(channel)
                self.gate_kick.set()  # what changed while not subscribed
                self._gate_listening = True
                while not self._stop.is_set():
                    if pubsub.get_message(timeout=1.0) is not None:
                        self.gate_kick.set()
            except Exception:  # Redis away: the gate polls meanwhile
                log.debug("gate channel lost; polling", exc_info=True)
                self._stop.wait(1.0)
            finally:
                self._gate_listening = False
                with contextlib.suppress(Exception):
                    pubsub.close()

    def _gate_loop(self) -> None:
        while not self._stop.is_set():
            self.gate_kick.wait(self._gate_period_s())
            self.gate_kick.clear()
            c = self._consumer
            if c is None or getattr(c, "task_consumer", None) is None:
                continue
            if self.info.role != "prefill":  # it consumes its DC's pool queues
                self.read_shared_prefill()
            queued: dict[str, int] = {}
            if not self.broker_orders_queues:
                try:
                    queued = (
                        self.queue_depths(self.queues) if self.queue_depths else self.state.queued()
                    )
                except Exception:  # noqa: BLE001
                    queued = {}
            try:
                if self.desired_queues(queued) == [q.name for q in c.task_consumer.queues]:
                    continue
            except Exception:  # noqa: BLE001
                continue
            hub = getattr(c, "hub", None)
            if hub is not None:
                hub.call_soon(self._apply_gate, c, queued)
            else:  # pragma: no cover - event loop disabled
                self._apply_gate(c, queued)
            time.sleep(0.05)

    def _apply_gate(self, c: Any, queued: dict[str, int]) -> None:
        """Consume the desired queues (consumer thread only). Decided here, not
        in the gate thread: ``on_received`` runs on this thread too, so a
        message that filled its tier since the gate looked is counted."""
        try:
            want = self.desired_queues(queued)
            have = [q.name for q in c.task_consumer.queues]
            n = 0  # keep the common prefix; re-add the rest in priority order
            while n < min(len(want), len(have)) and want[n] == have[n]:
                n += 1
            for q in have[n:]:
                c.cancel_task_queue(q)
            for q in want[n:]:
                self._resume(c, q)
        except Exception:
            log.debug("tier gate not applied", exc_info=True)

    def _resume(self, c: Any, name: str) -> None:
        """Consume ``name`` again (consumer thread only), without declaring it
        again when this connection's consumer already did.

        Celery's ``add_task_queue`` declares the queue each time: on Redis a
        ``LLEN`` per priority and an ``SADD`` of its binding, 0.5-1 ms of the
        consumer thread per queue. The gate closes and reopens the pool queues
        around every prompt that fills the prefill budget (an 8k-token prompt
        does), and reopening restores priority order by re-adding the
        affinity queues behind them too: about 3.6 ms of the consumer thread
        per request, in which it received nothing."""
        q = c.app.amqp.queues.get(name) if name in self._declared else None
        if q is None:
            c.add_task_queue(name)
            self._declared.add(name)
            return
        was = q.no_declare
        q.no_declare = True  # the consumer binds a copy of it: the copy skips declaring
        try:
            c.add_task_queue(name)
        finally:
            q.no_declare = was

    def _kv_loop(self) -> None:
        """Relay the engine's vLLM KV events to the shared prefix index stream."""
        from tokenfleet.emulator.kv_events import KVEventSubscriber

        assert self.kv_events_endpoint is not None
        try:
            sub = KVEventSubscriber(self.kv_events_endpoint, instance_id=self.info.instance_id)
        except Exception:
            log.exception("cannot subscribe to KV events at %s", self.kv_events_endpoint)
            self.exact_kv_events = False
            return
        try:
            while not self._stop.is_set():
                events = sub.poll(timeout_s=0.2)
                if events:
                    try:
                        self.state.publish_kv_events(events)
                        self.kv_events_relayed += len(events)
                    except Exception:  # noqa: BLE001
                        log.debug("KV events dropped: Redis unavailable")
        finally:
            sub.close()


#: the runtime of this worker process (set by ``tokenfleet worker`` before Celery starts)
RUNTIME: WorkerRuntime | None = None


#: scrapes in a row an idle instance's accounting must stay unchanged before
#: it is cleared (4 x 0.5 s: longer than a KV transfer and a decode's first step)
ACCT_REPAIR_SCRAPES = 4


def runtime() -> WorkerRuntime:
    if RUNTIME is None:
        raise RuntimeError("worker runtime not initialised; start workers with `tokenfleet worker`")
    return RUNTIME
