"""The simulator side of admission: pooled tier queues in front of a PoolSim.

The driver plays the live gateway. On arrival it classifies the request and
asks the admission policy to admit (then routes at once), queue or reject
it. Whenever capacity may have freed (a first token, a completion, a
periodic tick while queues are non-empty) it asks the policy which queued
request to dispatch next, until the policy says none. It keeps the exact
per-instance, per-tier accounting a gateway has of its own dispatches, and
every control period it hands the policy one ``WindowStats`` (the input of
the feedback controller) and records the knobs in force for the timeline.

Clients give up after their timeout (per request, else per tier from the
SLO file): streaming clients (every tier but batch) if no first token has
arrived by then, batch clients if the response is not complete. A queued
request is simply removed (nothing was spent); a dispatched one is aborted
in the engine and its spent work counted as waste.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokenfleet.core.admission import (
    ADMISSION,
    ADMIT,
    DISPATCH,
    QUEUE,
    Admission,
    AdmissionSnapshot,
    InstanceLoad,
    QueuedRequest,
    TierQueue,
    WindowStats,
)
from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.tiers import SLOConfig, classify, meets_slo
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    TIERS,
    CompletionEvent,
    FirstTokenEvent,
    RequestInfo,
)
from tokenfleet.sim.cluster import PoolConfig, PoolSim, new_record
from tokenfleet.sim.core import Environment
from tokenfleet.sim.records import RequestRecord
from tokenfleet.workloads.trace import TraceRequest

ProgressFn = Callable[[int, int], None]


@dataclass(slots=True)
class _Flight:
    instance: int
    uncached_tokens: int
    reserved_kv_tokens: int
    dispatched_s: float
    first_token: bool = False


@dataclass
class AdmissionStats:
    """Run-level admission facts that records do not carry."""

    retry_after_s: dict[str, float] = field(default_factory=dict)  # rejected rid -> s
    timeline: list[dict[str, Any]] = field(default_factory=list)
    policy_wall_s: float = 0.0


class AdmissionDriver:
    """Per-tier gateway queues + admission policy in front of one pool."""

    def __init__(
        self,
        env: Environment,
        pool: PoolSim,
        policy: Admission,
        slo: SLOConfig,
        *,
        control_period_s: float = 5.0,
        dispatch_tick_s: float | None = None,
        on_done: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        if control_period_s <= 0:
            raise ValueError("control_period_s must be > 0")
        self.env = env
        self.pool = pool
        self.policy = policy
        self.slo = slo
        self.period_s = control_period_s
        self.tick_s = (
            dispatch_tick_s
            or getattr(policy, "dispatch_tick_s", None)
            or pool.cfg.scrape_interval_s
        )
        self.on_done = on_done
        self.queues: dict[str, TierQueue] = {t: TierQueue(t) for t in TIERS}
        self.loads = [InstanceLoad(view=v) for v in pool.views[0]]
        self._traces: dict[str, TraceRequest] = {}  # queued: rid -> trace (tier set)
        self._records: dict[str, RequestRecord] = {}  # not yet final
        self._infos: dict[str, RequestInfo] = {}
        self._flights: dict[str, _Flight] = {}
        self._queued_tier: dict[str, str] = {}
        self.stats = AdmissionStats()
        self.window = WindowStats(period_s=control_period_s)
        self._window_start = env.now
        self._expected = 0  # arrivals scheduled but not yet final
        self._batch_deadlines: dict[str, float] = {}
        self._pumping = False
        self._pump_soon = False
        self._ticking = False
        self._uses_queues = policy.uses_queues()
        # what the live gateway's prefix index holds: the engines' KV events
        # (every 16th block: 256-token steps, 16x cheaper to keep than the live
        # gateway's exact index, and finer than anything admission decides on)
        self.index = PrefixIndex(stride_blocks=16)
        if pool.cfg.kv_events:
            pool.on_kv_event = self.index.apply
        pool.on_dispatch = self._on_dispatch
        pool.on_first_token = self._on_first_token
        pool.on_done = self._on_done

    # -- setup -----------------------------------------------------------------------
    def schedule(self, requests: Sequence[TraceRequest]) -> None:
        """Schedule arrivals; control ticks run until every request is final."""
        env = self.env
        # A gateway scrapes continuously; start before the first arrival.
        self.pool.ensure_scraping()
        for tr in requests:
            env.schedule_at(tr.info.arrival_s, self.arrive, tr)
        self._expected += len(requests)
        if requests:
            env.schedule(self.period_s, self._control_tick)

    # -- arrivals --------------------------------------------------------------------
    def arrive(self, trace: TraceRequest) -> None:
        env = self.env
        info = trace.info
        tier = classify(info, self.slo)
        if tier != info.tier:
            info = replace(info, tier=tier)
            trace = replace(trace, info=info)
        rid = info.request_id
        rec = new_record(info, self.pool.cfg.dc)
        self._records[rid] = rec
        self._infos[rid] = info
        self.window.tier(tier).arrivals += 1
        if tier == "batch":
            dl = info.deadline_s
            if dl is None and self.slo.slo_for(tier).deadline_s is not None:
                dl = info.arrival_s + float(self.slo.slo_for(tier).deadline_s or 0.0)
            self._batch_deadlines[rid] = dl if dl is not None else float("inf")
        timeout = trace.client_timeout_s
        if timeout is None:
            timeout = self.slo.slo_for(tier).client_timeout_s
        if timeout is not None:
            env.schedule(timeout, self._client_timeout, rid)
        t0 = time.perf_counter()
        dec = self.policy.on_arrival(info, self._snapshot(info))
        self.stats.policy_wall_s += time.perf_counter() - t0
        if dec.action == ADMIT:
            self.pool.submit(trace, rec, dec.instance_ids)
        elif dec.action == QUEUE:
            self.queues.setdefault(tier, TierQueue(tier)).append(QueuedRequest(info, env.now))
            self._traces[rid] = trace
            self._queued_tier[rid] = tier
            self._start_ticking()
        else:
            if dec.retry_after_s is not None:
                self.stats.retry_after_s[rid] = dec.retry_after_s
            self._finalize(rec, "rejected")
        self._pump()

    def _client_timeout(self, request_id: str) -> None:
        """Streaming clients (every tier but batch) wait for the first token
        only: once tokens flow, the user reads on. Batch clients wait for the
        whole response."""
        fl = self._flights.get(request_id)
        info = self._infos.get(request_id)
        if fl is not None and fl.first_token and info is not None and info.tier != "batch":
            return
        self.cancel(request_id)

    def cancel(self, request_id: str, status: str = "cancelled") -> bool:
        """The client gave up. Queued: just removed. Dispatched: aborted, waste counted."""
        tier = self._queued_tier.pop(request_id, None)
        if tier is not None:
            self.queues[tier].remove(request_id)
            self._traces.pop(request_id, None)
            rec = self._records.get(request_id)
            if rec is not None:
                self._finalize(rec, status)
            self._pump_later()
            return True
        return self.pool.cancel(request_id, status)

    # -- dispatch loop ---------------------------------------------------------------
    def _snapshot(self, arriving: RequestInfo | None = None) -> AdmissionSnapshot:
        cached = {}
        if arriving is not None and arriving.block_hashes:
            cap = arriving.input_tokens
            held = self.index.match(arriving.block_hashes)  # one walk for every holder
            cached = {i: min(cap, n * BLOCK_SIZE_TOKENS) for i, n in held.items()}
        return AdmissionSnapshot(
            now_s=self.env.now, instances=self.loads, queues=self.queues, cached_tokens=cached
        )

    def _pump(self) -> None:
        if not self._uses_queues or self._pumping:
            return
        if not any(len(q) for q in self.queues.values()):
            return
        self._pumping = True
        try:
            guard = sum(len(q) for q in self.queues.values()) + 1
            while guard > 0:
                guard -= 1
                t0 = time.perf_counter()
                act = self.policy.next_action(self._snapshot())
                self.stats.policy_wall_s += time.perf_counter() - t0
                if act is None:
                    break
                q = self.queues.get(act.tier)
                item = q.remove(act.request_id) if q is not None else None
                if item is None:
                    raise RuntimeError(
                        f"admission policy {self.policy.name!r} chose "
                        f"{act.request_id}, which is not queued in {act.tier!r}"
                    )
                self._queued_tier.pop(act.request_id, None)
                trace = self._traces.pop(act.request_id)
                rec = self._records[act.request_id]
                if act.kind == DISPATCH:
                    self.pool.submit(trace, rec, act.instance_ids)
                else:
                    if act.retry_after_s is not None:
                        self.stats.retry_after_s[act.request_id] = act.retry_after_s
                    self._finalize(rec, act.status)
        finally:
            self._pumping = False

    def _pump_later(self) -> None:
        """Pump after the current event: pool hooks fire inside an engine step,
        and dispatching from there would re-enter the pool mid-step."""
        if self._uses_queues and not self._pump_soon:
            self._pump_soon = True
            self.env.schedule(0.0, self._deferred_pump)

    def _deferred_pump(self) -> None:
        self._pump_soon = False
        self._pump()

    def _start_ticking(self) -> None:
        if not self._ticking and self._uses_queues:
            self._ticking = True
            self.env.schedule(self.tick_s, self._dispatch_tick)

    def _dispatch_tick(self) -> None:
        if not any(len(q) for q in self.queues.values()):
            self._ticking = False
            return
        self.pool.ensure_scraping()
        self._pump()
        self.env.schedule(self.tick_s, self._dispatch_tick)

    # -- pool hooks ------------------------------------------------------------------
    def _on_dispatch(self, info: RequestInfo, idx: int, expected_cached_tokens: int) -> None:
        uncached = max(0, info.input_tokens - expected_cached_tokens)
        reserved = self.policy.kv_reserve_tokens(info)
        tl = self.loads[idx].tier(info.tier)
        tl.inflight += 1
        tl.prefill_pending += 1
        tl.prefill_pending_tokens += uncached
        tl.dispatched_uncached_tokens += uncached
        tl.reserved_kv_tokens += reserved
        self._flights[info.request_id] = _Flight(idx, uncached, reserved, self.env.now)
        w = self.window.tier(info.tier)
        w.dispatched += 1
        w.prefill_tokens += uncached
        if info.tier == "batch" and info.input_tokens >= self.slo.long_context_min_input_tokens:
            self.window.batch_long_tokens += uncached

    def _on_first_token(self, info: RequestInfo, idx: int) -> None:
        fl = self._flights.get(info.request_id)
        if fl is None or fl.first_token:
            return
        fl.first_token = True
        tl = self.loads[idx].tier(info.tier)
        tl.prefill_pending -= 1
        tl.prefill_pending_tokens -= fl.uncached_tokens
        now = self.env.now
        w = self.window.tier(info.tier)
        w.first_tokens += 1
        limit = self.slo.slo_for(info.tier).ttft_limit_s(info.input_tokens)
        if limit is None or now - info.arrival_s <= limit:
            w.ttft_met += 1
        self.policy.on_first_token(
            FirstTokenEvent(info, self.loads[idx].instance_id, now, now - fl.dispatched_s)
        )
        self._pump_later()

    def _on_done(self, rec: RequestRecord) -> None:
        rid = rec.request_id
        fl = self._flights.pop(rid, None)
        info = self._infos.get(rid)
        if fl is not None and info is not None:
            tl = self.loads[fl.instance].tier(info.tier)
            if not fl.first_token:
                tl.prefill_pending -= 1
                tl.prefill_pending_tokens -= fl.uncached_tokens
            tl.inflight -= 1
            tl.reserved_kv_tokens -= fl.reserved_kv_tokens
            self.policy.on_complete(
                CompletionEvent(
                    info,
                    self.loads[fl.instance].instance_id,
                    self.env.now,
                    rec.status,
                    rec.output_tokens,
                    rec.cached_tokens,
                    None if rec.first_token_s is None else rec.first_token_s - fl.dispatched_s,
                    self.env.now - fl.dispatched_s,
                )
            )
        self._finalize(rec, rec.status, already_final=True)
        self._pump_later()

    def _finalize(self, rec: RequestRecord, status: str, already_final: bool = False) -> None:
        if not already_final:
            rec.status = status
            rec.finish_s = self.env.now
        rid = rec.request_id
        if self._records.pop(rid, None) is None:
            return  # already final (defensive: a hook fired twice)
        info = self._infos.pop(rid, None)
        tier = rec.tier
        w = self.window.tier(tier)
        w.finished += 1
        st = rec.status
        if st == "completed":
            w.completed += 1
            w.output_tokens += rec.output_tokens
        elif st == "rejected":
            w.rejected += 1
        elif st == "cancelled":
            w.cancelled += 1
        elif st == "timed_out":
            w.timed_out += 1
        elif st == "failed":
            w.failed += 1
        elif st == "duplicate":
            w.duplicates += 1
        w.wasted_gpu_s += rec.wasted_gpu_s
        dl = None if rec.deadline_s is None else rec.deadline_s - rec.arrival_s
        if meets_slo(
            self.slo.slo_for(tier),
            status=st,
            input_tokens=rec.input_tokens,
            ttft_s=rec.ttft_s,
            tpot_s=rec.tpot_s,
            e2e_s=rec.e2e_s,
            deadline_in_s=dl,
        ):
            w.met += 1
            w.good_tokens += rec.output_tokens
        if info is not None and tier == "batch":
            self._batch_deadlines.pop(rid, None)
            self.window.batch_finished += 1
        self._expected -= 1
        if self.on_done is not None:
            self.on_done(rec)

    # -- control period ----------------------------------------------------------------
    def _control_tick(self) -> None:
        now = self.env.now
        w = self.window
        w.period_s = now - self._window_start
        for tier, q in self.queues.items():
            w.tier(tier).queued = len(q)
        for inst in self.loads:
            for tier, load in inst.tiers.items():
                if load.inflight:
                    w.tier(tier).inflight += load.inflight
        w.batch_remaining = len(self._batch_deadlines)
        thr = self.slo.long_context_min_input_tokens
        bq = self.queues.get("batch")
        long_batch = (
            [it.request.input_tokens for it in bq if it.request.input_tokens >= thr] if bq else []
        )
        w.batch_long_queued = len(long_batch)
        w.batch_long_queued_tokens = sum(long_batch)
        w.batch_deadline_s = min(self._batch_deadlines.values(), default=None)
        t0 = time.perf_counter()
        knobs = self.policy.on_window(w, now)
        self.stats.policy_wall_s += time.perf_counter() - t0
        sample: dict[str, Any] = {"t_s": now, "knobs": dict(knobs), "tiers": {}}
        for tier, tw in sorted(w.tiers.items()):
            sample["tiers"][tier] = {
                "arrivals": tw.arrivals,
                "finished": tw.finished,
                "met": tw.met,
                "attainment": tw.attainment,
                "ttft_attainment": tw.ttft_attainment,
                "rejected": tw.rejected,
                "cancelled": tw.cancelled,
                "queued": tw.queued,
                "inflight": tw.inflight,
                "dispatched": tw.dispatched,
                "good_tokens": tw.good_tokens,
                "output_tokens": tw.output_tokens,
            }
        self.stats.timeline.append(sample)
        self.window = WindowStats(period_s=self.period_s)
        self._window_start = now
        if self._expected > 0:
            self.env.schedule(self.period_s, self._control_tick)


def create_policy(name: str, slo: SLOConfig, **kwargs: object) -> Admission:
    return ADMISSION.create(name, slo=slo, **kwargs)


def run_pool_with_admission(
    requests: Sequence[TraceRequest],
    config: PoolConfig,
    slo: SLOConfig,
    admission: str,
    *,
    admission_kwargs: dict[str, object] | None = None,
    control_period_s: float = 5.0,
    progress: ProgressFn | None = None,
) -> tuple[list[RequestRecord], PoolSim, AdmissionDriver]:
    """Replay ``requests`` through admission + one pool; return per-request records."""
    policy = create_policy(admission, slo, **(admission_kwargs or {}))
    env = Environment()
    records: list[RequestRecord] = []
    total = len(requests)
    step = max(1, total // 200)

    def done(rec: RequestRecord) -> None:
        records.append(rec)
        if progress is not None and (len(records) % step == 0 or len(records) == total):
            progress(len(records), total)

    from tokenfleet.sim.pd import make_pool

    pool = make_pool(env, config, slo)
    driver = AdmissionDriver(
        env, pool, policy, slo, control_period_s=control_period_s, on_done=done
    )
    driver.schedule(requests)
    env.run()
    records.sort(key=lambda r: (r.arrival_s, r.request_id))
    return records, pool, driver


def admission_report(
    records: Sequence[RequestRecord], driver: AdmissionDriver, slo: SLOConfig
) -> dict[str, Any]:
    """What the JSON adds for an admission run: Retry-After honesty, batch
    deadline, and the controller timeline."""
    ra = sorted(driver.stats.retry_after_s.values())
    batch = [r for r in records if r.tier == "batch"]
    deadline_met: bool | None = None
    last_batch_finish: float | None = None
    batch_deadline: float | None = None
    if batch:
        deadline_met = all(r.slo_met for r in batch)
        last_batch_finish = max((r.finish_s or 0.0) for r in batch)
        dls = [r.deadline_s for r in batch if r.deadline_s is not None]
        batch_deadline = max(dls) if dls else None
    return {
        "admission": driver.policy.name,
        "rejected_with_retry_after": len(ra),
        "retry_after_p50_s": ra[len(ra) // 2] if ra else None,
        "retry_after_max_s": ra[-1] if ra else None,
        "batch_deadline_met": deadline_met,
        "batch_last_finish_s": last_batch_finish,
        "batch_deadline_s": batch_deadline,
        "policy_wall_s": driver.stats.policy_wall_s,
        "timeline": driver.stats.timeline,
    }
