"""Send a validated request on its way: datacenter, admission, router, pin, publish.

In order: FleetMind picks the datacenter (when DC selection is on), admission
may narrow or refuse (SLOMax), the router picks the instance, a
``prompt_cache_key`` pin may override it, and the expected cache hit decides
between the instance's own queue and the datacenter's pool queue (late
binding). Then one Redis round trip writes the request state, the queue
depth, the accounting and counters and, when the broker is this Redis, the
Celery message itself (:class:`~tokenfleet.live.jobs.ChatJob`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import redis
from kombu.exceptions import KombuError

from tokenfleet.core.routing.base import TwoPhaseRouter
from tokenfleet.core.routing.pd_base import PDRouter, split
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    DispatchAccounting,
    InstanceView,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
)
from tokenfleet.errors import NoCandidateError
from tokenfleet.live import steps
from tokenfleet.live.brokers import DcBrokers
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.dc_select import DCTicket
from tokenfleet.live.engine_client import EngineCall, first_token_timeout_s
from tokenfleet.live.gateway.direct import DirectCalls, engine_call
from tokenfleet.live.gateway.errors import (
    AtCapacity,
    ClientClosed,
    HeldTooLong,
    NoCapacity,
    RegionNotAllowed,
    StoreUnavailable,
)
from tokenfleet.live.gateway.holding import Hold, HoldingPen
from tokenfleet.live.gateway.pump import PumpSink
from tokenfleet.live.gateway.validate import ChatRequest
from tokenfleet.live.jobs import TASK_CHAT, ChatJob, send_chat_job
from tokenfleet.live.queues import affinity_queue, pool_queue
from tokenfleet.live.relay import RelayEvent, RelayHub, RelayWriter, Subscription
from tokenfleet.live.state import InstanceInfo, LiveState
from tokenfleet.service.writer import RequestRecord

log = logging.getLogger("tokenfleet.api")

#: the fleet view is re-aggregated from the instance snapshots at most this often
DC_VIEWS_REFRESH_S = 0.1
#: a prompt_cache_key pins its conversation to an instance this long (seconds)
PIN_TTL_S = 600
#: tiers whose queued requests wait in the API (holding.py); batch keeps its broker queue
HELD_TIERS = frozenset(("interactive", "long_context"))


@dataclass(frozen=True, slots=True)
class HoldWait:
    """How a caller that can wait lets admission hold its request
    (:mod:`~tokenfleet.live.gateway.holding`): the front gate it leaves
    meanwhile, and whether its client is still there."""

    leave_gate: Callable[[], None]
    gone: Callable[[], bool] | None = None


@dataclass(slots=True)
class Dispatched:
    """A request on its way, as the gateway follows it until it ends."""

    request: ChatRequest
    job: ChatJob  # the attempt last published (re-sends start from it)
    queue: str
    instance: str  # routed instance ('' when the router had no opinion)
    decision: RouteDecision | None
    dispatch_s: float
    affinity: bool
    attempt: int = 1
    redispatches: int = 0
    first_token_s: float | None = None
    #: instance of the first token whose policy feedback has not run yet
    first_token_due: str | None = None
    tokens: int = 0  # completion tokens relayed so far
    #: instance of the attempt serving this client now (direct path: from its
    #: ``go``; relay path: its tokens), '' after a re-send: the API's own rows
    #: then say where the request ran even if that worker's row never lands
    serving: str = ""
    state_checked_s: float = 0.0
    dc_ticket: DCTicket | None = None  # the DC choice's accounting, settled at the end
    #: the request's stream as this process's relay hub delivers it
    sub: Subscription | None = None
    #: where the stream pump sends the tokens after the first (pump.py); None:
    #: the request's thread reads the engine itself
    sink: PumpSink | None = None
    #: express dispatch: the hand-over of the first attempt, which this
    #: process claimed and runs itself (no broker message, no worker)
    express: RelayEvent | None = None
    #: its engine call, sent before the dispatch's writes (None once read)
    express_call: EngineCall | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def drop_express_call(self, reason: str) -> None:
        """The express call was sent but its stream will not be read: abort it."""
        if self.express_call is not None:
            self.express_call.discard(reason)
            self.express_call = None


def ledger_record(info: RequestInfo, status: str, **columns: Any) -> RequestRecord:
    """The ledger row of a request the API settles itself (rejected, timed out, ...)."""
    base: dict[str, Any] = {
        "request_id": info.request_id,
        "tenant_id": info.tenant,
        "tier": info.tier,
        "model": info.model,
        "status": status,
        "arrival_ts": info.arrival_s,
        "prompt_tokens": info.input_tokens,
    }
    base.update(columns)
    return RequestRecord(**base)


class Dispatcher:
    """Part of :class:`~tokenfleet.live.gateway.Gateway`: admission, routing, publishing."""

    state: LiveState
    celery: Any
    live: LiveConfig
    slo: SLOConfig
    ledger: Any
    admission: Any
    router: Any
    router_lock: threading.Lock
    dc_selector: Any
    index: Any
    index_lock: threading.Lock
    accounting: Any
    peer_apis: int
    metrics: Any
    tenant_regions: Callable[[str], Sequence[str]] | None
    _publisher: Any
    brokers: DcBrokers
    relay_hub: RelayHub
    direct_calls: DirectCalls
    wait_predictor: Any
    _dc_views_at: float
    _dc_views_dcs: frozenset[str]
    _depths: dict[str, int]
    _depths_at: float
    _mean_tokens: dict[str, tuple[float, float]]
    tier_shares: dict[str, float]
    express_running: dict[tuple[str, str], int]
    express_lock: threading.Lock
    holding: HoldingPen | None

    if TYPE_CHECKING:  # from LiveView

        def instances(self, max_age_s: float = ...) -> list[InstanceInfo]: ...
        def _refresh_admission_knobs(self, max_age_s: float = ...) -> None: ...
        def _refresh_depths(self) -> None: ...
        def await_prefetch(self) -> None: ...
        def _refresh_fleet_plan(self, max_age_s: float = ...) -> None: ...

    def dispatch(self, req: ChatRequest, hold: HoldWait | None = None) -> Dispatched:
        """Route and publish ``req``; raises a :class:`GatewayError` when it cannot.
        With ``hold``, a request admission queues waits here until admission
        releases it (:mod:`~tokenfleet.live.gateway.holding`); without, it is
        routed at once into its tier's pool queue."""
        h: Hold | None = None
        try:
            return self._dispatch(req, hold)
        except _Held as held:
            h = held.hold
            assert hold is not None
            return self._dispatch(req, None, self._wait_held(req, h, hold))
        finally:
            if h is not None:
                h.booked.set()  # the holding thread may decide the next one

    def _dispatch(
        self,
        req: ChatRequest,
        hold: HoldWait | None,
        released: tuple[str, ...] | None = None,
    ) -> Dispatched:
        info = req.info
        steps.stamp("dispatch")
        self.await_prefetch()
        steps.stamp("prefetched")
        now = time.time()
        call: EngineCall | None = None  # express dispatch's engine call, once started
        try:
            views, dc_choice, allowed_dcs = self._pick_dc(req, self._views(now), now)
            held = self._cached_by_instance(info)  # one walk of the index per request
            if released is not None:  # admission released it from the holding pen
                allowed: tuple[str, ...] | None = released or None
            else:
                allowed = self._admit(req, views, now, held, hold is not None)
            steps.stamp("admitted")
            # a P/D router places both phases by role once the pool is split;
            # SLOMax's per-tier instance split would hide the prefill pool (as
            # in the simulator's P/D pool)
            if allowed is not None and not (isinstance(self.router, PDRouter) and split(views)):
                views = [v for v in views if v.instance_id in allowed] or views
            for i, v in enumerate(views):
                v.index = i
            decision, prefill, prebooked = self._route(req, views, now)
            steps.stamp("routed")
            target = next(v for v in views if v.instance_id == decision.instance_id)
            if prefill is None:
                target, sticky = self._sticky(req, views, target)
            else:  # the decode instance pulls the prompt's KV: nothing to prefill there
                sticky = True
            cached = (
                decision.expected_cached_tokens if target.instance_id == decision.instance_id else 0
            )
            cached = min(max(cached, held.get(target.instance_id, 0)), info.input_tokens)
            affinity = sticky or self._pinned(info, cached, target)
            express = self._express(info, target, prefill)
            affinity = affinity or express is not None
            if affinity:
                queue = affinity_queue(target.dc, target.instance_id, info.tier)
            else:
                queue = pool_queue(target.dc, info.tier)
            admitted = time.time()
            log.debug(
                "route %s: %s -> %s (expected cached %d, %s)",
                info.request_id,
                decision.instance_id,
                queue,
                cached,
                decision.reason,
            )
            job = ChatJob(
                request_id=info.request_id,
                attempt=1,
                tenant=info.tenant,
                tier=info.tier,
                model=info.model,
                body=req.body,
                input_tokens=info.input_tokens,
                max_tokens=info.max_tokens,
                arrival_ts=info.arrival_s,
                queue=queue,
                admitted_ts=admitted,
                accounted=target.instance_id if affinity else "",
                dc=target.dc,
                expected_cached=cached,
                allowed_dcs=allowed_dcs,
                deadline_ts=req.deadline_s,
                direct=self.direct_calls.api_id if self.live.direct_stream else "",
            )
            if prefill is not None:
                job.prefill_instance, job.prefill_cached = prefill
                job.prefill_url = next(
                    i.url for i in self.instances() if i.instance_id == prefill[0]
                )
            # request state, queue depth, accounting, counters and (when the broker
            # is this Redis) the task itself: one round trip, the state first, so a
            # worker never takes a task whose state is missing (the id is a fresh
            # uuid, so no existence check is needed); the stream is subscribed to
            # first, and the same round trip wakes the relay hub
            if prebooked is not None and (not affinity or prebooked[0] != target.instance_id):
                # booked for another dispatch than the one published
                self.state.unbook(*prebooked)
                prebooked = None
            go = None
            if express is not None:
                # the engine starts on the prompt while the state is written: its
                # answer is read only after the writes (and a failure of theirs
                # aborts it), so no token leaves before the state says whose it is
                go = self._express_go(job, express)
                call = engine_call(go.facts or {}, job, self.live)
                steps.stamp("engine_call")
                call.start()
                steps.stamp("engine_sent")
            sub = self.relay_hub.subscribe(info.request_id)
            try:
                self._dispatch_writes(
                    req, job, target, affinity, cached, dc_choice, prebooked, express is not None
                )
            except KombuError as exc:
                sub.close()
                raise StoreUnavailable(
                    f"the message broker is unavailable ({exc.__class__.__name__}); retry shortly"
                ) from None
            except BaseException:
                sub.close()
                if call is not None:
                    call.discard("dispatch failed")
                raise
            steps.stamp("state_written")
            if express is not None:
                with self.express_lock:
                    key = (target.instance_id, info.tier)
                    self.express_running[key] = self.express_running.get(key, 0) + 1
            self._ledger(
                ledger_record(info, "in_flight", admitted_ts=admitted, dc=target.dc, attempts=1)
            )
        except redis.RedisError as exc:
            if call is not None:
                call.discard("dispatch failed")
            raise StoreUnavailable(
                f"the live state store is unavailable ({exc.__class__.__name__}); retry shortly"
            ) from None
        self._published(info)
        ticket = None
        if dc_choice is not None and self.dc_selector is not None:
            with self.router_lock:
                try:
                    ticket = self.dc_selector.dispatched(info, dc_choice[0])
                except NoCandidateError:  # the pool vanished between choice and send
                    ticket = None
        # the router's choice: a pin elsewhere is corrected like late binding, at
        # the first token (feedback: rebind)
        return Dispatched(
            request=req,
            job=job,
            queue=queue,
            instance=decision.instance_id,
            decision=decision,
            dispatch_s=admitted,
            affinity=affinity,
            dc_ticket=ticket,
            sub=sub,
            express=go,
            express_call=call,
        )

    def _views(self, now: float) -> list[InstanceView]:
        """The router's views of every instance, less those of datacenters whose
        broker is down (their requests spill, residency allowing)."""
        views = self.state.instance_views(
            now, self.live.stale_after_s, self.instances(), self.accounting.get
        )
        if down := self.brokers.down_dcs(now):
            views = [v for v in views if v.dc not in down]
        return views

    # -- admission ----------------------------------------------------------------------
    def _admit(
        self,
        req: ChatRequest,
        views: list[Any],
        now: float,
        held: Mapping[str, int],
        can_hold: bool = False,
    ) -> tuple[str, ...] | None:
        """Admission policy at arrival: None = anywhere, else allowed instance ids.
        ``held``: the prompt's tokens each instance holds (:meth:`_cached_by_instance`).
        A request it queues is held in this process (raises :class:`_Held`)
        when ``can_hold`` and its tier waits here (:data:`HELD_TIERS`)."""
        if self.admission is None:
            return None
        from tokenfleet.core.admission import ADMIT, QUEUE, REJECT, AdmissionSnapshot

        self._refresh_admission_knobs()
        self._shed_late(req, views, now)
        dcs = {v.dc for v in views}
        queues = self._broker_queues(dcs, req.info)
        pen = self.holding
        if pen is not None and len(pen):
            queues = _with_held(queues, pen.totals())
        snap = AdmissionSnapshot(
            now_s=now,
            instances=self._admission_loads(views),
            queues=queues,
            cached_tokens=held,
        )
        with self.router_lock:
            decision = self.admission.on_arrival(req.info, snap)
        if decision.action == REJECT:
            self._reject(
                req, decision.reason, decision.retry_after_s, dcs.pop() if len(dcs) == 1 else None
            )
        if decision.action == QUEUE and can_hold and pen is not None:
            if req.info.tier in HELD_TIERS:
                raise _Held(pen.hold(req.info, now))
        if decision.action == ADMIT and decision.instance_ids:
            return tuple(decision.instance_ids)
        return None

    def _admission_loads(self, views: Sequence[Any]) -> list[Any]:
        """Each ready instance as admission sees it: running requests per tier
        (the workers' counts and this process's own express attempts), and what
        every API and worker booked there (the shared dispatch accounting), as
        the simulator's driver keeps it: the prefill not yet done, per tier,
        and the KV reserved for prompt + output budget (SLOMax's default
        reserve; a learned quantile would reserve less)."""
        from tokenfleet.core.admission import InstanceLoad

        loads = []
        infos = {i.instance_id: i for i in self.instances()}
        with self.express_lock:  # the workers' counts lack this process's own attempts
            own = dict(self.express_running)
        for v in views:
            if not v.ready:
                continue
            load = InstanceLoad(view=v)
            rbt = infos[v.instance_id].running_by_tier if v.instance_id in infos else {}
            for tier in {*rbt, *(t for i, t in own if i == v.instance_id)}:
                load.tier(tier).inflight = rbt.get(tier, 0) + own.get((v.instance_id, tier), 0)
            acc = v.accounting
            for tier, (n, tokens) in acc.tier_prefill_pending().items():
                if n:
                    tl = load.tier(tier)
                    tl.prefill_pending, tl.prefill_pending_tokens = n, tokens
            load.untiered_reserved_kv_tokens = acc.inflight_input_tokens + acc.inflight_max_tokens
            loads.append(load)
        return loads

    def release_held(self, queues: Mapping[str, Any], now: float) -> Any:
        """The admission policy's next action over this process's held
        requests (the holding thread's question), on the instances as they are now."""
        from tokenfleet.core.admission import AdmissionSnapshot

        assert self.admission is not None
        self._refresh_admission_knobs()
        loads = self._admission_loads(self._views(now))
        snap = AdmissionSnapshot(now_s=now, instances=loads, queues=queues)
        if not snap.instances:
            return None
        with self.router_lock:
            return self.admission.next_action(snap)

    def _wait_held(self, req: ChatRequest, h: Hold, hold: HoldWait) -> tuple[str, ...]:
        """Wait, outside the front gate, until admission releases ``req``: the
        instances it may go to (empty: any). Raises when admission drops it
        (429), its client leaves (499) or the request timeout passes (504);
        each leaves its ledger row."""
        from tokenfleet.core.admission import DISPATCH

        assert self.holding is not None
        info = req.info
        hold.leave_gate()
        if self.metrics is not None:
            self.metrics.held(info.tier, 1)
        try:
            left_s = info.arrival_s + self.live.request_timeout_s - time.time()
            act = self.holding.wait(h, time.monotonic() + max(0.0, left_s), hold.gone)
        finally:
            if self.metrics is not None:
                self.metrics.held(info.tier, -1)
        if act is None:
            gone = hold.gone is not None and hold.gone()
            status = "cancelled" if gone else "timed_out"
            self._ledger(ledger_record(info, status, finished_ts=time.time()))
            if self.metrics is not None:
                self.metrics.finished(info.tier, status, tenant=info.tenant)
            if gone:
                raise ClientClosed("the client closed its connection while the request was held")
            raise HeldTooLong(
                f"held for admission until the request timeout "
                f"({self.live.request_timeout_s:.0f}s); retry later"
            )
        if act.kind != DISPATCH:
            self._reject(req, act.reason or "dropped while held", act.retry_after_s)
        return act.instance_ids or ()

    def _cached_by_instance(self, info: RequestInfo) -> dict[str, int]:
        """The prompt's tokens each instance holds, by the engines' KV events
        (instances holding none are left out)."""
        if not info.block_hashes:
            return {}
        with self.index_lock:
            held = self.index.match(info.block_hashes)  # one walk for every holder
        cap = info.input_tokens
        return {i: min(cap, n * BLOCK_SIZE_TOKENS) for i, n in held.items()}

    def _shed_late(self, req: ChatRequest, views: list[Any], now: float) -> None:
        """Refuse (429) a request whose predicted queue wait in its datacenter is
        over its tier's limit (:class:`~tokenfleet.live.gateway.overload.WaitPredictor`)."""
        from tokenfleet.live.gateway.refresh import QUEUE_DEPTHS_MAX_AGE_S

        dcs = {v.dc for v in views}
        if len(dcs) != 1:
            return  # DC selection off: admission alone
        dc = next(iter(dcs))
        if time.monotonic() - self._depths_at > QUEUE_DEPTHS_MAX_AGE_S:
            try:
                self._refresh_depths()
            except redis.RedisError:
                return
        ids = [v.instance_id for v in views]

        def totals() -> list[int]:
            return [a.dispatched_total for a in self.accounting.get(ids).values()]

        try:
            self.wait_predictor.check(req.info, dc, self._depths, totals)
        except AtCapacity as exc:
            self._reject(req, str(exc), exc.retry_after_s, dc, message=exc.message)

    def _broker_queues(self, dcs: set[str], info: RequestInfo) -> dict[str, Any]:
        """What waits in the chosen DC's broker queues, per tier, as admission totals.

        Counts come from the per-queue depth counters in Redis (the API adds
        at publish, the worker that takes a task subtracts); prompt tokens are
        the count times the mean prompt this API published to that tier (this
        request's own size until it has published any).
        """
        from tokenfleet.core.admission import QueueTotals
        from tokenfleet.live.gateway.refresh import QUEUE_DEPTHS_MAX_AGE_S

        if time.monotonic() - self._depths_at > QUEUE_DEPTHS_MAX_AGE_S:
            try:
                self._refresh_depths()
            except redis.RedisError:
                self._depths, self._depths_at = {}, time.monotonic()
        n_by_tier: dict[str, int] = {}
        for queue, n in self._depths.items():
            parts = queue.split(".")
            if n > 0 and len(parts) in (2, 3) and parts[0] in dcs:
                n_by_tier[parts[-1]] = n_by_tier.get(parts[-1], 0) + n
        out = {}
        for tier, n in n_by_tier.items():
            mean_in, mean_out = self._mean_tokens.get(
                tier, (float(info.input_tokens), float(info.max_tokens))
            )
            out[tier] = QueueTotals(tier, n, int(n * mean_in), int(n * (mean_in + mean_out)))
        return out

    def _published(self, info: RequestInfo) -> None:
        """Running mean prompt and budget of what this API published, per tier."""
        mean_in, mean_out = self._mean_tokens.get(
            info.tier, (float(info.input_tokens), float(info.max_tokens))
        )
        a = 0.05
        self._mean_tokens[info.tier] = (
            mean_in + a * (info.input_tokens - mean_in),
            mean_out + a * (info.max_tokens - mean_out),
        )

    def _reject(
        self,
        req: ChatRequest,
        reason: str,
        retry_after_s: float | None,
        dc: str | None = None,
        message: str | None = None,
    ) -> None:
        info = req.info
        self._ledger(
            ledger_record(info, "rejected", dc=dc, finished_ts=time.time(), error=reason[:500])
        )
        try:
            self.state.count(**{f"rejected_{info.tier}": 1})
        except redis.RedisError:
            pass
        if self.metrics is not None:
            self.metrics.finished(info.tier, "rejected", tenant=info.tenant)
        raise AtCapacity(
            message
            or f"TokenFleet is at capacity for {info.tier} requests ({reason}); "
            "retry after the indicated delay",
            retry_after_s=retry_after_s if retry_after_s is not None else 1.0,
        )

    # -- datacenter choice (FleetMind) ------------------------------------------------------
    def _tenant(self, tenant_id: str) -> Any:
        assert self.dc_selector is not None
        regions: Sequence[str] = ()
        if self.tenant_regions is not None:
            try:
                regions = self.tenant_regions(tenant_id)
            except Exception:  # noqa: BLE001 - tenancy store down: topology rules only
                log.warning(
                    "tenant %s: allowed regions unavailable; using the topology's", tenant_id
                )
        return self.dc_selector.tenant(tenant_id, regions)

    def _pick_dc(
        self, req: ChatRequest, views: list[Any], now: float
    ) -> tuple[list[Any], tuple[Any, str | None] | None, tuple[str, ...]]:
        """FleetMind picks the datacenter; the router then sees only its instances.

        Returns the chosen DC's views, (decision, home) for the accounting and
        the datacenters the tenant may be served in (``()``: any), or all views,
        None and ``()`` when DC selection is off.
        """
        if self.dc_selector is None:
            return views, None, ()
        info = req.info
        self._refresh_fleet_plan()
        tenant = self._tenant(info.tenant)
        # the datacenters the views span: one whose broker went down (or came
        # back) since the last refresh must not be chosen from a stale copy
        # (its requests would find no instance: a 503 "check the deployment")
        dcs = frozenset(v.dc for v in views)
        with self.router_lock:
            if (
                now - self._dc_views_at >= DC_VIEWS_REFRESH_S
                or now < self._dc_views_at
                or dcs != self._dc_views_dcs
            ):
                self.dc_selector.refresh(views, now)
                self._dc_views_at, self._dc_views_dcs = now, dcs
            self.dc_selector.snap.now_s = now
            why = ""
            try:
                decision, home = self.dc_selector.select(info, tenant)
                ok = self.dc_selector.compliant_dcs(info, tenant)
                allowed_dcs = () if len(ok) >= len(self.dc_selector.views) else tuple(sorted(ok))
            except NoCandidateError as exc:
                why = str(exc)
                permitted = self.dc_selector.permitted_anywhere(info, tenant)
        if why:
            if not permitted:
                raise RegionNotAllowed(
                    f"tenant '{info.tenant}' may not use any datacenter that serves "
                    f"`{info.model}` (its allowed regions or sites exclude them); ask the "
                    "operator to widen the tenant's allowed regions",
                    param="model",
                )
            raise NoCapacity(f"no datacenter can serve this request now ({why})")
        if self.metrics is not None:
            self.metrics.dc_decision(decision.dc, decision.reason)
        chosen = [v for v in views if v.dc == decision.dc]
        return chosen, (decision, home), allowed_dcs

    # -- instance choice ----------------------------------------------------------------
    def _route(
        self, req: ChatRequest, views: list[Any], now: float
    ) -> tuple[RouteDecision, tuple[str, int] | None, tuple[str, dict[str, int]] | None]:
        """The router's choice; for a disaggregated one (a P/D router's
        ``route_pd``) the prefill instance and its expected cached tokens; and
        (instance, deltas) when the booking check already booked the dispatch."""
        try:
            with self.router_lock:
                snap = PoolSnapshot(now_s=now, instances=views)
                if not isinstance(self.router, PDRouter):
                    if self._checks_booking(req):
                        return self._checked_route(req, snap)
                    decision: RouteDecision = self.router.route(req.info, snap)
                    return decision, None, None
                pd = self.router.route_pd(req.info, snap)
        except NoCandidateError as exc:
            raise NoCapacity(
                f"no healthy engine instance can take this request now ({exc})"
            ) from None
        if not pd.disaggregated:
            decision = RouteDecision(
                pd.prefill_instance_id, pd.expected_cached_tokens, pd.predicted_ttft_s, pd.reason
            )
            return decision, None, None
        p_id = pd.prefill_instance_id
        # the decode side receives the whole prompt's KV but its last token
        whole = max(0, req.info.input_tokens - 1)
        decision = RouteDecision(
            str(pd.decode_instance_id),
            whole,
            pd.predicted_ttft_s,
            f"{pd.reason} (prefill on {p_id})",
        )
        return decision, (p_id, pd.expected_cached_tokens), None

    def _checks_booking(self, req: ChatRequest) -> bool:
        """Other API replicas are alive, so this one's accounting copy may lack
        their last dispatches; a ``prompt_cache_key`` pin decides by itself."""
        return (
            self.live.booking_check
            and self.peer_apis > 0
            and not req.info.prompt_cache_key
            and isinstance(self.router, TwoPhaseRouter)
        )

    def _checked_route(
        self, req: ChatRequest, snap: PoolSnapshot
    ) -> tuple[RouteDecision, None, tuple[str, dict[str, int]] | None]:
        """Propose; book an affinity dispatch, whose reply is the instance's
        accounting with every replica's bookings; propose again on that when it
        shows dispatches our copy lacked; commit. (The simulator's
        ``PoolSim._checked_route`` does the same with ``--shared-state-ms``.)
        Called with the router lock held: propose and commit are one decision."""
        info = req.info
        proposed = self.router.propose(info, snap)
        view = next(v for v in snap.instances if v.instance_id == proposed.instance_id)
        if not self._pinned(info, proposed.expected_cached_tokens, view):
            return self.router.commit(info), None, None  # the pool's worker books it
        delta, fresh = self.state.book_dispatch(
            view.instance_id, info, proposed.expected_cached_tokens
        )
        booked: tuple[str, dict[str, int]] | None = (view.instance_id, delta)
        try:
            if fresh.dispatched_total > view.accounting.dispatched_total:
                shown = [replace(v, accounting=fresh) if v is view else v for v in snap.instances]
                again = self.router.propose(info, replace(snap, instances=shown))
                if self.metrics is not None:
                    self.metrics.booking_recheck(again.instance_id != view.instance_id)
                if again.instance_id != view.instance_id or not self._pinned(
                    info, again.expected_cached_tokens, view, fresh
                ):
                    self.state.unbook(view.instance_id, delta)
                    booked = None
            return self.router.commit(info), None, booked
        except BaseException:
            if booked is not None:  # the request goes nowhere: neither does its booking
                with contextlib.suppress(redis.RedisError):
                    self.state.unbook(*booked)
            raise

    def _pinned(
        self,
        info: RequestInfo,
        cached_tokens: int,
        view: InstanceView,
        acc: DispatchAccounting | None = None,
    ) -> bool:
        """To the chosen instance's own queue, else to the pool (late binding):
        a cache hit worth waiting for there, or (``affinity_when_idle``) an
        instance that would pull the request from the pool at once anyway:
        its prefill queue (nearly) empty and a slot free, by the API's
        accounting (``acc``: a fresher copy than the view's), and nothing of
        the request's tier waiting in the pool that it would overtake. Then
        the router's choice among such instances stands, as in the simulator
        (docs/benchmarks.md, section 15: TTFT level, cache hits as simulated)."""
        if (
            cached_tokens >= self.live.affinity_min_cached_tokens
            and cached_tokens >= self.live.affinity_min_cached_fraction * info.input_tokens
        ):
            return True
        if not self.live.affinity_when_idle:
            return False
        acc = view.accounting if acc is None else acc
        if acc.prefill_pending_uncached_tokens >= self.live.pool_prefill_budget_tokens:
            return False
        slots = next((i.slots for i in self.instances() if i.instance_id == view.instance_id), 0)
        if acc.inflight_requests >= slots:
            return False
        return self._depths.get(pool_queue(view.dc, info.tier), 0) <= 0

    def _express(
        self, info: RequestInfo, view: InstanceView, prefill: tuple[str, int] | None
    ) -> InstanceInfo | None:
        """The instance to run the request on from this process (express
        dispatch, ``LiveConfig.express_dispatch``), or None: through the broker.

        Only where the broker and a worker add nothing but their hop: the
        router's choice has a slot free and its prefill queue under the
        budget by the API's dispatch accounting, and nothing of the tier waits
        for it or its pool (the request would overtake it). Not for a
        disaggregated request (its prefill side opens on the worker)."""
        live = self.live
        if not (live.express_dispatch and live.direct_stream) or prefill is not None:
            return None
        inst = next((i for i in self.instances() if i.instance_id == view.instance_id), None)
        if inst is None or inst.role == "prefill":
            return None
        acc = view.accounting
        if acc.prefill_pending_uncached_tokens >= live.pool_prefill_budget_tokens:
            return None
        if acc.inflight_requests >= inst.slots:
            return None
        # a tier the workers' gate caps below all slots (SLOMax's shares) goes
        # through the gate: this process cannot count the tier's running work
        if math.ceil(self.tier_shares.get(info.tier, 1.0) * inst.slots) < inst.slots:
            return None
        depths = self._depths
        for q in (
            pool_queue(view.dc, info.tier),
            affinity_queue(view.dc, view.instance_id, info.tier),
        ):
            if depths.get(q, 0) > 0:
                return None
        return inst

    def _express_go(self, job: ChatJob, inst: InstanceInfo) -> RelayEvent:
        """The hand-over a worker would have written (``RelayWriter.go_fields``)."""
        uncached = max(0, job.input_tokens - job.expected_cached)
        wait_s = first_token_timeout_s(
            self.live.engine_stall_timeout_s, self.state.profile(inst.profile), uncached
        )
        fields = RelayWriter(self.state, job.request_id, 0, inst.instance_id).go_fields(
            inst.api_url or inst.url,
            f"{job.request_id}-{job.attempt}",
            job.attempt,
            exact_kv_events=inst.exact_kv,
            first_token_timeout_s=wait_s,
        )
        # as read back from the stream: strings
        facts = {k: str(v) for k, v in fields.items()}
        return RelayEvent("go", instance=inst.instance_id, facts=facts)

    def _sticky(self, req: ChatRequest, views: list[Any], target: Any) -> tuple[Any, bool]:
        """``prompt_cache_key``: the client's own affinity hint. The first request
        with a key pins it to the routed instance for ten minutes; later ones
        go to that instance's own queue while it is healthy. Returns (the
        instance to send to, whether to its own queue); a pinned instance the
        DC choice or admission left out keeps its pin, and this request goes
        where the router sent it, through the pool."""
        key = req.info.prompt_cache_key
        if not key:
            return target, False
        pinned_id = self.state.pin(req.info.tenant, key)
        now = time.time()
        if pinned_id is not None:
            for i in self.instances():
                if i.instance_id == pinned_id and i.is_healthy(now, self.live.stale_after_s):
                    self.state.renew_pin(req.info.tenant, key, PIN_TTL_S)
                    there = next((v for v in views if v.instance_id == pinned_id), None)
                    return (there, True) if there is not None else (target, False)
        self.state.set_pin(req.info.tenant, key, target.instance_id, PIN_TTL_S)
        return target, True

    # -- publishing -----------------------------------------------------------------------
    def _window_counts(self, info: RequestInfo, cached: int, how: str) -> dict[str, int]:
        """Counters beat's SLOMax controller reads per window: arrivals, and the
        uncached prompt tokens published per tier (its feed-forward sizes the
        long-context lane by this work mix). Counted when published, the
        router's cache estimate standing in for the engine's; the simulator
        counts at dispatch to an engine, with the same estimate."""
        uncached = max(0, info.input_tokens - cached)
        out = {
            f"arrived_{info.tier}": 1,
            f"dispatched_{how}": 1,
            f"prefill_tokens_{info.tier}": uncached,
        }
        if info.tier == "batch" and info.input_tokens >= self.slo.long_context_min_input_tokens:
            out["batch_long_tokens"] = uncached
        return out

    def _dispatch_writes(
        self,
        req: ChatRequest,
        job: ChatJob,
        target: Any,
        affinity: bool,
        cached: int,
        dc_choice: tuple[Any, str | None] | None,
        prebooked: tuple[str, dict[str, int]] | None = None,
        express: bool = False,
    ) -> None:
        """``prebooked``: the booking check already wrote this dispatch's
        accounting; undone here if the publish fails. ``express``: claimed
        here for this process (:meth:`_express`), nothing published."""
        info = req.info
        # the task joins the state's round trip only when it goes to that same Redis
        joined = None if express or self.brokers.own(target.dc) else self._publisher
        booked: dict[str, int] = {}
        try:
            with self.state.batch() as b:
                b.create_request(
                    info.request_id,
                    job.queue,
                    self.live.request_state_ttl_s,
                    tier=info.tier,
                    instance=target.instance_id,
                )
                if express:
                    b.own_request(
                        info.request_id,
                        self.direct_calls.owner,
                        self.live.lease_ttl_s,
                        target.instance_id,
                    )
                else:
                    b.queued(job.queue, 1)
                if affinity:  # the cache estimate may have grown since a prebooking
                    already = prebooked[1] if prebooked is not None else None
                    booked = b.account(target.instance_id, "on_dispatch", info, cached, already)
                how = "affinity" if affinity else "pool"
                b.count(**self._window_counts(info, cached, how))
                if express:
                    b.count(dispatched_express=1)
                if dc_choice is not None and dc_choice[1] not in (None, target.dc):
                    # beat's planner needs each DC's spilled-in share (rollback rule)
                    b.count(**{f"spilled_in:{target.dc}": 1})
                self.relay_hub.wake(b.pipe)
                if joined is not None:
                    # a KombuError here leaves the batch unsent: nothing to undo
                    # (but a prebooking, below)
                    joined.publish(
                        b.pipe, TASK_CHAT, [job.to_message()], job.task_id, job.queue, job.headers()
                    )
        except BaseException:
            if prebooked is not None:  # the batch did not run: take the booking back
                with contextlib.suppress(redis.RedisError):
                    self.state.unbook(*prebooked)
            raise
        if booked:  # the pool's dispatches are booked by the worker that claims them
            self.accounting.wrote(target.instance_id, booked)
        if joined is not None or express:
            return
        try:
            send_chat_job(self.brokers.send_task, job)
        except KombuError as exc:
            self.brokers.mark_down(target.dc, f"publish: {exc.__class__.__name__}")
            self.state.finish(info.request_id, "failed")
            self.state.queued_incr(job.queue, -1)
            if booked:
                self.state.unbook(target.instance_id, booked)
            raise

    def _publish(self, job: ChatJob) -> None:
        """Publish a re-send (its queue depth first)."""
        self.state.queued_incr(job.queue)
        send_chat_job(self.brokers.send_task, job)

    def _ledger(self, row: RequestRecord) -> None:
        if self.ledger is None:
            return
        try:
            self.ledger.record(row)
        except Exception:
            log.exception("ledger row not recorded")


class _Held(Exception):
    """Admission queued the request and this process holds it (``hold``)."""

    def __init__(self, hold: Hold) -> None:
        super().__init__(hold.info.request_id)
        self.hold = hold


def _with_held(queues: dict[str, Any], held: Mapping[str, tuple[int, int, int]]) -> dict[str, Any]:
    """The broker queues' totals plus what this process holds, per tier."""
    from tokenfleet.core.admission import QueueTotals

    out = dict(queues)
    for tier, (n, tokens, reserved) in held.items():
        q = out.get(tier)
        if q is not None:
            n, tokens, reserved = n + q.n, tokens + q.input_tokens, reserved + q.reserved_tokens
        out[tier] = QueueTotals(tier, n, tokens, reserved)
    return out
