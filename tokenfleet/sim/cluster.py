"""The simulator's driver for one model pool: arrivals, routing, engines, scrapes.

The driver plays the part of the live service. It owns the truth (engines,
true output lengths) and hands each policy only what a live router could
see: its own dispatch accounting and the metrics of the last scrape.

Router replicas: with ``n_routers > 1`` each replica is a separate policy
object with separate accounting; scraped metrics are shared (they come from
the engines), accounting is not, unless ``shared_state_s`` says the replicas
share it, as the live API replicas do through Redis: then each sees the
others' changes that much later. Arrivals are spread over replicas with a
seeded random draw, as a load balancer in front of them would.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from tokenfleet.core.routing import ROUTERS, Router, TwoPhaseRouter
from tokenfleet.core.tiers import SLOConfig, classify
from tokenfleet.core.types import (
    CompletionEvent,
    DispatchAccounting,
    FirstTokenEvent,
    InstanceView,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
    ScrapedMetrics,
)
from tokenfleet.engine.instance import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    EngineInstance,
    EngineRequest,
    StepResult,
)
from tokenfleet.engine.profiles import EngineProfile
from tokenfleet.errors import CapacityError, NoCandidateError
from tokenfleet.sim.core import URGENT, Environment
from tokenfleet.sim.records import RequestRecord
from tokenfleet.workloads.trace import TraceRequest

ProgressFn = Callable[[int, int], None]
#: (env, config, slo, on_done) -> the pool :func:`run_pool` replays through
PoolFactory = Callable[
    [Environment, "PoolConfig", SLOConfig, Callable[[RequestRecord], None]], "PoolSim"
]


@dataclass(frozen=True, slots=True)
class PathLatency:
    """Latency of the live request path, which the simulator otherwise takes as zero.

    ``dispatch``: from a request's arrival (the client sends it) to its engine
    receiving it (API, broker, worker, HTTP); ``relay``: from the engine's
    first token to the client (worker, Redis stream, API, SSE). Each is
    ``min_s`` plus an exponential tail of mean ``tail_s`` (a fixed cost of
    the hops plus waiting for CPU and I/O), drawn per request from a seeded
    generator of its own. Routing still happens at arrival, as the API routes
    when the request comes in; the engine sees the request ``dispatch`` later
    and the client its tokens ``relay`` later (records carry client times;
    policy callbacks keep engine times). Measure it on the live system
    (:func:`tokenfleet.live.bench.path_latency`); the default (all zero) is
    the idealised path.
    """

    dispatch_min_s: float = 0.0
    dispatch_tail_s: float = 0.0
    relay_min_s: float = 0.0
    relay_tail_s: float = 0.0

    @property
    def is_zero(self) -> bool:
        return not (
            self.dispatch_min_s or self.dispatch_tail_s or self.relay_min_s or self.relay_tail_s
        )

    def draw(self, rng: random.Random) -> tuple[float, float]:
        """(dispatch, relay) seconds for one request."""
        d = self.dispatch_min_s + (
            rng.expovariate(1.0 / self.dispatch_tail_s) if self.dispatch_tail_s > 0 else 0.0
        )
        r = self.relay_min_s + (
            rng.expovariate(1.0 / self.relay_tail_s) if self.relay_tail_s > 0 else 0.0
        )
        return d, r


@dataclass(slots=True)
class _Flight:
    """Driver bookkeeping for one dispatched request."""

    trace: TraceRequest
    info: RequestInfo
    record: RequestRecord
    replica: int
    instance: int
    expected_cached_tokens: int
    predicted_ttft_s: float | None
    engine_req: EngineRequest
    got_first_token: bool = False
    done: bool = False
    relay_s: float = 0.0  # first token (and end) reach the client this much later
    #: the instance the admission hooks were told of at dispatch (-1: ``instance``);
    #: a disaggregated request is dispatched to its prefill instance, decoded elsewhere
    hook_instance: int = -1


@dataclass
class PoolConfig:
    profile: EngineProfile
    n_instances: int = 8
    router: str = "round_robin"
    router_kwargs: dict[str, object] = field(default_factory=dict)
    n_routers: int = 1
    scrape_interval_s: float = 0.1
    seed: int = 0
    dc: str = "local"
    model: str = "default"
    model_version: str = ""
    kv_capacity_blocks: int | None = None
    # Deliver vLLM-style KV events (BlockStored/BlockRemoved) from the engines
    # to every router replica at the end of each step, as a live KV-event
    # subscriber would; routers with an exact-cache mode then use it.
    kv_events: bool = False
    # Latency of the live path (API, broker, worker, relay); zero by default.
    path_latency: PathLatency = field(default_factory=PathLatency)
    # Router replicas share dispatch accounting, each seeing the others'
    # dispatches, first tokens and completions this much later (the live API
    # replicas' Redis accounting, refreshed about every 20 ms). None: every
    # replica knows only its own (the independent worst case).
    shared_state_s: float | None = None
    # With shared accounting, a replica books a dispatch before it is final:
    # the booking answers with the chosen instance's current accounting, and a
    # dispatch the replica's late view lacked makes it propose again (routers
    # with ``propose``/``commit``; the live API does the same). False: the
    # decision on the late view stands.
    booking_check: bool = True


def _apply(
    acc: DispatchAccounting, op: str, info: RequestInfo, cached: int, got_first: bool
) -> None:
    """One logged accounting change (``dispatch``, ``first`` or ``finish``)."""
    if op == "dispatch":
        acc.on_dispatch(info, cached)
    elif op == "first":
        acc.on_first_token(info, cached)
    else:
        acc.on_finish(info, got_first, cached)


class SharedAccounting:
    """The others' accounting changes, delivered to each replica ``lag_s`` late.

    One time-ordered log of (time, replica, instance, change); each replica
    applies the others' entries once they are ``lag_s`` old, as it would on
    reading the shared store. Its own changes it applies at once (the live
    ``AccountingView`` adds this replica's own writes to what it last read).
    """

    def __init__(self, views: list[list[InstanceView]], lag_s: float) -> None:
        self.views = views
        self.lag_s = lag_s
        self.log: list[tuple[float, int, int, str, RequestInfo, int, bool]] = []
        self.start = 0  # log index of entry 0 after trimming
        self.cursor = [0] * len(views)

    def record(
        self,
        now: float,
        replica: int,
        idx: int,
        op: str,
        info: RequestInfo,
        cached: int,
        got_first: bool = False,
    ) -> None:
        self.log.append((now, replica, idx, op, info, cached, got_first))

    def booked(self, replica: int, idx: int, acc: DispatchAccounting) -> DispatchAccounting | None:
        """What booking a dispatch to ``idx`` would answer: ``acc`` (the
        replica's view of it) plus the others' changes it has not applied
        yet, or None when none of those is a dispatch (nothing to re-decide)."""
        log, start = self.log, self.start
        unseen = [e for e in log[self.cursor[replica] - start :] if e[2] == idx and e[1] != replica]
        if not any(e[3] == "dispatch" for e in unseen):
            return None
        out = replace(acc)
        for _, _, _, op, info, cached, got_first in unseen:
            _apply(out, op, info, cached, got_first)
        return out

    def catch_up(self, replica: int, now: float) -> None:
        log, start = self.log, self.start
        i = self.cursor[replica]
        horizon = now - self.lag_s
        views = self.views[replica]
        while i - start < len(log) and log[i - start][0] <= horizon:
            _, who, idx, op, info, cached, got_first = log[i - start]
            if who != replica:
                _apply(views[idx].accounting, op, info, cached, got_first)
            i += 1
        self.cursor[replica] = i
        low = min(self.cursor)
        if low - start > 4096:  # every replica is past these entries
            del log[: low - start]
            self.start = low


class PoolSim:
    """One pool of engine instances behind one or more router replicas."""

    def __init__(
        self,
        env: Environment,
        config: PoolConfig,
        slo: SLOConfig,
        on_done: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self.env = env
        self.cfg = config
        self.slo = slo
        self.on_done = on_done
        prof = config.profile
        self.engines = [
            EngineInstance(f"{config.dc}/i{i}", prof, config.kv_capacity_blocks)
            for i in range(config.n_instances)
        ]
        self.metrics = [ScrapedMetrics() for _ in self.engines]
        self.routers: list[Router] = []
        self.views: list[list[InstanceView]] = []
        for r in range(config.n_routers):
            kwargs = dict(config.router_kwargs)
            kwargs.setdefault("seed", config.seed * 1000 + r)
            self.routers.append(ROUTERS.create(config.router, **kwargs))
            self.views.append(
                [
                    InstanceView(
                        instance_id=e.instance_id,
                        profile=prof,
                        dc=config.dc,
                        model=config.model,
                        model_version=config.model_version,
                        kv_capacity_tokens=e.capacity_blocks * e.block,
                        max_model_len_tokens=prof.model.max_model_len_tokens,
                        metrics=self.metrics[i],
                        accounting=DispatchAccounting(),
                        index=i,
                    )
                    for i, e in enumerate(self.engines)
                ]
            )
        self.by_index = {e.instance_id: i for i, e in enumerate(self.engines)}
        self._two_phase = [
            config.booking_check and isinstance(r, TwoPhaseRouter) for r in self.routers
        ]
        self._shared: SharedAccounting | None = None
        if config.shared_state_s is not None and config.n_routers > 1:
            self._shared = SharedAccounting(self.views, config.shared_state_s)
        self._kv_pending: list[KVEvent] = []
        if config.kv_events:
            for e in self.engines:
                e.kv_listener = self._kv_sink(e.instance_id)
                # vLLM's offloading connector publishes its tier on the same stream
                e.host_listener = self._kv_sink(e.instance_id, MEDIUM_CPU)
        self._flights: dict[str, _Flight] = {}
        self._rng = random.Random(config.seed)
        # a generator of its own, so path latencies leave the replica draws alone
        self._latency_rng = random.Random(config.seed * 7919 + 17)
        self.inflight = 0
        #: proposals re-made after a booking showed another replica's dispatch
        self.booking_rechecks = 0
        self._scraping = False
        # Optional hooks for an admission layer in front of the routers
        # (tokenfleet.sim.admission): dispatch with the router's cache estimate,
        # and first tokens. Completions go through ``on_done``.
        self.on_dispatch: Callable[[RequestInfo, int, int], None] | None = None
        #: every KV event the routers receive (a gateway's own prefix index)
        self.on_kv_event: Callable[[KVEvent], None] | None = None
        self.on_first_token: Callable[[RequestInfo, int], None] | None = None

    # -- arrivals and routing -------------------------------------------------
    def submit(
        self,
        trace: TraceRequest,
        record: RequestRecord | None = None,
        allowed: Sequence[str] | None = None,
    ) -> None:
        """A request reaches this pool now: route it and hand it to an engine.

        ``allowed`` (from admission) restricts the instances the router sees.
        """
        env = self.env
        self._ensure_scraping()
        info = trace.info
        if not info.tier:
            info = _with_tier(info, classify(info, self.slo))
        if record is None:
            record = new_record(info, self.cfg.dc)
        replica = self._rng.randrange(len(self.routers)) if len(self.routers) > 1 else 0
        record.router_replica = replica
        views = self.views[replica]
        if self._shared is not None:
            self._shared.catch_up(replica, env.now)
        shown = views if not allowed else [v for v in views if v.instance_id in allowed]
        snap = PoolSnapshot(now_s=env.now, instances=shown, router_id=replica)
        self._route_and_dispatch(trace, info, record, replica, snap)

    def _route_and_dispatch(
        self,
        trace: TraceRequest,
        info: RequestInfo,
        record: RequestRecord,
        replica: int,
        snap: PoolSnapshot,
    ) -> None:
        """Ask the replica's router, then hand the request to that engine
        (a P/D pool overrides this to run two-phase requests)."""
        router = self.routers[replica]
        try:
            if self._shared is not None and self._two_phase[replica]:
                decision = self._checked_route(cast(TwoPhaseRouter, router), info, replica, snap)
            else:
                decision = router.route(info, snap)
        except NoCandidateError:
            self._finish_unrouted(record, "rejected")
            return
        self._dispatch(trace, info, record, replica, decision)

    def _checked_route(
        self, router: TwoPhaseRouter, info: RequestInfo, replica: int, snap: PoolSnapshot
    ) -> RouteDecision:
        """Propose, book (learning the chosen instance's current shared
        accounting, as the live API's booking reply says), and propose again
        when the booking shows dispatches the replica's view lacked."""
        assert self._shared is not None
        proposed = router.propose(info, snap)
        idx = self.by_index[proposed.instance_id]
        view = self.views[replica][idx]
        fresh = self._shared.booked(replica, idx, view.accounting)
        if fresh is not None:
            shown = [replace(v, accounting=fresh) if v is view else v for v in snap.instances]
            router.propose(info, replace(snap, instances=shown))
            self.booking_rechecks += 1
        return router.commit(info)

    def _dispatch(
        self,
        trace: TraceRequest,
        info: RequestInfo,
        record: RequestRecord,
        replica: int,
        decision: RouteDecision,
    ) -> None:
        env = self.env
        views = self.views[replica]
        idx = self.by_index[decision.instance_id]
        eng_req = EngineRequest(
            info.request_id,
            info.input_tokens,
            min(trace.output_tokens, info.max_tokens),
            info.block_hashes,
            trace.output_block_hashes,
        )
        engine = self.engines[idx]
        latency = self.cfg.path_latency
        dispatch_s = relay_s = 0.0
        try:
            if latency.is_zero:
                engine.add(eng_req)
            else:  # it reaches the engine later (_reach_engine); refuse it now if it never fits
                engine.check(eng_req)
                dispatch_s, relay_s = latency.draw(self._latency_rng)
        except CapacityError:
            self._finish_unrouted(record, "rejected")
            return
        record.dispatched_s = env.now
        record.instance_id = engine.instance_id
        record.dc = self.cfg.dc
        record.predicted_ttft_s = decision.predicted_ttft_s
        views[idx].accounting.on_dispatch(info, decision.expected_cached_tokens)
        if self._shared is not None:
            self._shared.record(
                env.now, replica, idx, "dispatch", info, decision.expected_cached_tokens
            )
        fl = _Flight(
            trace,
            info,
            record,
            replica,
            idx,
            decision.expected_cached_tokens,
            decision.predicted_ttft_s,
            eng_req,
            relay_s=relay_s,
        )
        self._flights[info.request_id] = fl
        self.inflight += 1
        if self.on_dispatch is not None:
            self.on_dispatch(info, idx, decision.expected_cached_tokens)
        if not latency.is_zero:
            env.schedule(dispatch_s, self._reach_engine, fl)
        elif not engine.stepping:
            self._start_step(idx)

    def _reach_engine(self, fl: _Flight) -> None:
        """The request arrives at its engine after the dispatch latency."""
        if fl.done:  # cancelled on the way
            return
        self.engines[fl.instance].add(fl.engine_req)
        if not self.engines[fl.instance].stepping:
            self._start_step(fl.instance)

    def cancel(self, request_id: str, status: str = "cancelled") -> bool:
        """Client gave up: abort in the engine; spent work becomes waste."""
        fl = self._flights.get(request_id)
        if fl is None or fl.done:
            return False
        engine = self.engines[fl.instance]
        fl.record.wasted_gpu_s += self._work_spent_s(fl, len(engine.running))
        engine.abort(request_id)
        self._complete(fl, status)
        return True

    # -- engine stepping -------------------------------------------------------
    def _start_step(self, idx: int) -> None:
        # Re-entrancy guard: a callback during _end_step may already have
        # dispatched (and so started the next step) on this engine.
        if self.engines[idx].stepping:
            return
        dur = self.engines[idx].plan_step()
        if dur > 0.0:
            self.env.schedule(dur, self._end_step, idx, priority=URGENT)

    def _kv_sink(
        self, instance_id: str, medium: str = MEDIUM_GPU
    ) -> Callable[[str, Sequence[int]], None]:
        def sink(kind: str, hashes: Sequence[int]) -> None:
            self._kv_pending.append(KVEvent(instance_id, kind, tuple(hashes), medium=medium))

        return sink

    def _publish_kv_events(self) -> None:
        events, self._kv_pending = self._kv_pending, []
        for ev in events:
            for router in self.routers:
                router.on_kv_event(ev)
            if self.on_kv_event is not None:
                self.on_kv_event(ev)

    def _end_step(self, idx: int) -> None:
        res = self.engines[idx].finish_step()
        if self._kv_pending:
            self._publish_kv_events()
        self._apply_step(idx, res)
        self._start_step(idx)

    def _apply_step(self, idx: int, res: StepResult) -> None:
        """First tokens and completions of one finished step."""
        engine = self.engines[idx]
        now = self.env.now
        flights = self._flights
        for er in res.first_tokens:
            fl = flights.get(er.request_id)
            if fl is None or fl.done:
                continue
            fl.got_first_token = True
            fl.record.first_token_s = now + fl.relay_s
            fl.record.cached_tokens = er.cached_tokens
            fl.record.host_hit_tokens = er.host_hit_tokens
            self.views[fl.replica][idx].accounting.on_first_token(
                fl.info, fl.expected_cached_tokens
            )
            if self._shared is not None:
                self._shared.record(
                    now, fl.replica, idx, "first", fl.info, fl.expected_cached_tokens
                )
            self.routers[fl.replica].on_first_token(
                FirstTokenEvent(
                    fl.info,
                    engine.instance_id,
                    now,
                    now - (fl.record.dispatched_s or now),
                    fl.predicted_ttft_s,
                )
            )
            if self.on_first_token is not None:
                self.on_first_token(fl.info, idx if fl.hook_instance < 0 else fl.hook_instance)
        for er in res.finished:
            fl = flights.get(er.request_id)
            if fl is None or fl.done:
                continue
            fl.record.output_tokens = er.generated_tokens
            self._complete(fl, "completed")

    def _complete(self, fl: _Flight, status: str) -> None:
        now = self.env.now
        fl.done = True
        self._flights.pop(fl.info.request_id, None)
        self.inflight -= 1
        rec = fl.record
        rec.finish_s = now + (fl.relay_s if status == "completed" else 0.0)
        rec.status = status
        self.views[fl.replica][fl.instance].accounting.on_finish(
            fl.info, fl.got_first_token, fl.expected_cached_tokens
        )
        if self._shared is not None:
            self._shared.record(
                now,
                fl.replica,
                fl.instance,
                "finish",
                fl.info,
                fl.expected_cached_tokens,
                fl.got_first_token,
            )
        self.routers[fl.replica].on_complete(
            CompletionEvent(
                fl.info,
                self.engines[fl.instance].instance_id,
                now,
                status,
                rec.output_tokens,
                rec.cached_tokens,
                None
                if rec.first_token_s is None
                else rec.first_token_s - (rec.dispatched_s or 0.0),
                now - (rec.dispatched_s or now),
            )
        )
        if self.on_done is not None:
            self.on_done(rec)

    def _finish_unrouted(self, record: RequestRecord, status: str) -> None:
        record.status = status
        record.finish_s = self.env.now
        if self.on_done is not None:
            self.on_done(record)

    def _work_spent_s(self, fl: _Flight, batch: int) -> float:
        """GPU time a cancelled request consumed: its prefill, plus its share of
        the decode steps it rode in (the batch it is in now stands for them)."""
        er = fl.engine_req
        prof = self.cfg.profile
        prefill = prof.prefill_time_s(
            max(0, er.computed_tokens - er.cached_tokens), er.cached_tokens
        )
        batch = max(1, batch)
        decode = er.generated_tokens * prof.decode_step_time_s(batch, er.input_tokens) / batch
        return prefill + decode

    # -- metrics scraping -----------------------------------------------------
    def _ensure_scraping(self) -> None:
        """Resume the scrape loop after an idle spell, on the same time grid.

        While the pool is idle nothing changes, so the scrape a continuous
        scraper took at the last grid point shows the current state: record it
        with that timestamp, then continue ticking from the next grid point.
        """
        if self._scraping:
            return
        self._scraping = True
        iv = self.cfg.scrape_interval_s
        grid = math.floor(self.env.now / iv) * iv
        self._read_metrics(grid)
        self.env.schedule_at(grid + iv, self._scrape)

    def ensure_scraping(self) -> None:
        """Keep metrics fresh while a gateway holds queued work (public alias)."""
        self._ensure_scraping()

    def _scrape(self) -> None:
        self._read_metrics(self.env.now)
        if self.inflight > 0:
            self.env.schedule(self.cfg.scrape_interval_s, self._scrape)
        else:
            # Idle pool: stop ticking so the event loop can end; resume on submit.
            self._scraping = False

    def _read_metrics(self, now: float) -> None:
        for eng, m in zip(self.engines, self.metrics, strict=False):
            m.scraped_at_s = now
            m.num_running = len(eng.running)
            m.num_waiting = len(eng.waiting)
            m.kv_usage = eng.kv_usage
            m.prefix_queries_total = eng.counters.prefix_queries_tokens
            m.prefix_hits_total = eng.counters.prefix_hits_tokens
            m.external_hits_total = eng.counters.external_hits_tokens

    # -- summaries ----------------------------------------------------------------
    def busy_s(self) -> list[float]:
        return [e.counters.busy_s for e in self.engines]

    def preemptions(self) -> int:
        return sum(e.counters.preemptions for e in self.engines)


def new_record(info: RequestInfo, dc: str = "") -> RequestRecord:
    return RequestRecord(
        request_id=info.request_id,
        tenant=info.tenant,
        tier=info.tier,
        arrival_s=info.arrival_s,
        input_tokens=info.input_tokens,
        max_tokens=info.max_tokens,
        dc=dc,
        deadline_s=info.deadline_s,
    )


def _with_tier(info: RequestInfo, tier: str) -> RequestInfo:
    return replace(info, tier=tier)


def run_pool(
    requests: Sequence[TraceRequest],
    config: PoolConfig,
    slo: SLOConfig,
    progress: ProgressFn | None = None,
    pool_factory: PoolFactory | None = None,
) -> tuple[list[RequestRecord], PoolSim]:
    """Replay ``requests`` through one pool; return per-request records.
    ``pool_factory`` builds the pool instead of :func:`tokenfleet.sim.pd.make_pool`
    (what-if engines or routers in a benchmark, e.g. ``benchmarks/p50_floor.py``)."""
    env = Environment()
    records: list[RequestRecord] = []
    total = len(requests)
    step = max(1, total // 200)

    def done(rec: RequestRecord) -> None:
        records.append(rec)
        if progress is not None and (len(records) % step == 0 or len(records) == total):
            progress(len(records), total)

    if pool_factory is None:
        from tokenfleet.sim.pd import make_pool

        pool_factory = make_pool
    pool = pool_factory(env, config, slo, done)
    for tr in requests:
        env.schedule_at(tr.info.arrival_s, pool.submit, tr)
        if tr.client_timeout_s is not None:
            env.schedule_at(
                tr.info.arrival_s + tr.client_timeout_s, pool.cancel, tr.info.request_id
            )
    env.run()
    records.sort(key=lambda r: (r.arrival_s, r.request_id))
    return records, pool
