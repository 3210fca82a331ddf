"""Beat's control loops, run as Celery tasks on the ``tokenfleet.control`` queue.

* ``control_tick`` (every ``control_period_s``): the SLOMax feedback
  controller (``tokenfleet.core.admission.controller.SLOMaxController``,
  called, not re-implemented). Its input window comes from the Redis
  counters workers and API replicas keep (arrivals, finishes, SLO met,
  rejections, failures per tier) and its output goes back to Redis: tier
  shares the worker gates apply (batch share of each engine's slots) and the
  admission knobs the API's SLOMax admission reads (``batch_share``,
  ``long_share``, ``reject_factor``). The controller's state round-trips
  through Redis, so a restarted beat continues where it was. Each tick also
  reads the ledger's per-tier goodput for the window (logged), and appends
  the shares to the ``tier_shares`` history.
* ``fleet_cycle`` (every ``fleet_period_s``): the FleetMind long cycle
  (``tokenfleet.core.fleet.Planner``) over per-DC ledger outcomes and the
  live instances; the resulting spill shares and replica targets are written
  to Redis (gateways apply the shares; ``tokenfleet up``'s actuator,
  ``tokenfleet.live.replicas``, prewarms and retires replicas to meet the
  targets) and the plan to ``fleet_events``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tokenfleet.core.types import TIERS
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.state import LiveState

log = logging.getLogger("tokenfleet.beat")


@dataclass
class ControlContext:
    live: LiveConfig
    state: LiveState
    db_engine: Any = None  # SQLAlchemy engine of the ledger, if any
    planner: Any = None
    last_plan_id: int = 0
    #: what the last INFO tick line said: ticks that change nothing log at DEBUG
    last_logged_tick: Any = None
    _topology: Any = None  # parsed once, on the first fleet cycle

    @property
    def topology(self) -> Any:
        """The topology file's Topology (None without one); read once per beat."""
        if self._topology is None and self.live.topology:
            from tokenfleet.live.dc_select import load_topology

            self._topology = load_topology(self.live.topology)
        return self._topology


CONTEXT: ControlContext | None = None


def _ctx() -> ControlContext:
    if CONTEXT is None:
        raise RuntimeError("control context not initialised; run `tokenfleet beat`")
    return CONTEXT


def _window(ctx: ControlContext, now: float) -> tuple[Any, dict[str, int], float]:
    from tokenfleet.core.admission import WindowStats

    st = ctx.state
    counters = st.counters()
    raw = st.r.get(st.k("control", "prev"))
    prev: dict[str, Any] = (
        json.loads(raw) if raw else {"at": now - ctx.live.control_period_s, "c": {}}
    )
    pc: dict[str, int] = dict(prev["c"])
    period = max(1e-3, now - float(prev["at"]))

    def delta(name: str) -> int:
        return max(0, counters.get(name, 0) - pc.get(name, 0))

    win = WindowStats(period_s=period)
    queued = st.queued()
    for tier in TIERS:
        w = win.tier(tier)
        w.arrivals = delta(f"arrived_{tier}")
        w.completed = delta(f"finished_{tier}")
        w.met = delta(f"slo_met_{tier}")
        w.rejected = delta(f"rejected_{tier}")
        w.failed = delta(f"failed_{tier}")
        w.finished = w.completed + w.rejected + w.failed
        w.queued = sum(n for q, n in queued.items() if q.endswith("." + tier))
        # the work mix that sizes the long-context lane (left at 0, the lane
        # kept its initial share whatever the traffic)
        w.prefill_tokens = delta(f"prefill_tokens_{tier}")
        w.first_tokens = delta(f"first_tokens_{tier}")
        w.ttft_met = delta(f"ttft_met_{tier}")
    win.batch_long_tokens = delta("batch_long_tokens")
    win.batch_remaining = win.tier("batch").queued
    win.batch_finished = win.tier("batch").completed
    return win, counters, period


def control_tick() -> dict[str, Any]:
    from tokenfleet.core.admission.controller import ControllerConfig, SLOMaxController

    ctx = _ctx()
    st = ctx.state
    now = time.time()
    win, counters, period = _window(ctx, now)
    ctrl = SLOMaxController(ControllerConfig(period_s=ctx.live.control_period_s))
    raw = st.r.get(st.k("control", "state"))
    if raw:
        try:
            ctrl.load_state(json.loads(raw))
        except (KeyError, ValueError, TypeError):
            log.warning("controller state in Redis unreadable; starting fresh")
    knobs = ctrl.update(win, now)
    shares = {"interactive": 1.0, "long_context": 1.0, "batch": knobs.batch_share}
    st.set_shares(shares, knobs.as_dict())
    with st.r.pipeline() as pipe:
        pipe.set(st.k("control", "state"), json.dumps(ctrl.state_dict()))
        pipe.set(st.k("control", "prev"), json.dumps({"at": now, "c": counters}))
        pipe.hincrby(st.k("counters"), "control_ticks", 1)
        pipe.execute()
    summary = {t: (w.met, w.finished) for t, w in win.tiers.items() if w.finished or w.arrivals}
    # quiet unless something changes: a tick that holds the same knobs is DEBUG
    # (a 1 s period would otherwise write thousands of identical lines an hour)
    said = (ctrl.last_reason, tuple(sorted((k, round(v, 3)) for k, v in _knob_items(knobs))))
    changed = said != ctx.last_logged_tick
    ctx.last_logged_tick = said
    level = logging.INFO if changed else logging.DEBUG
    if log.isEnabledFor(level):
        # the ledger's goodput is only for this line: a query a second otherwise
        ledger = _ledger_goodput(ctx, now - period, now, "tier")
        log.log(
            level,
            "SLOMax tick: %s | window %.1fs met/finished %s | ledger goodput %s",
            ctrl.last_reason,
            period,
            summary,
            ledger,
        )
    _record_shares(ctx, shares, knobs.as_dict(), ctrl.last_reason)
    return {"knobs": knobs.as_dict(), "reason": ctrl.last_reason, "window": summary}


def _knob_items(knobs: Any) -> list[tuple[str, float]]:
    return [(k, float(v)) for k, v in knobs.as_dict().items() if isinstance(v, int | float)]


def _ledger_goodput(
    ctx: ControlContext, since: float, until: float, group_by: str
) -> dict[str, Any]:
    if ctx.db_engine is None:
        return {}
    from tokenfleet.service.queries import goodput

    try:
        rows = goodput(
            ctx.db_engine,
            since=datetime.fromtimestamp(since, UTC),
            until=datetime.fromtimestamp(until, UTC),
            group_by=group_by,
        )
    except Exception as exc:  # noqa: BLE001 - the database may blip; control goes on
        log.warning("ledger unavailable for the control loop: %s", exc.__class__.__name__)
        return {}
    return {
        str(r.key): {
            "goodput_rps": round(r.goodput_rps, 3),
            "attainment": r.attainment,
            "total": r.total,
        }
        for r in rows
    }


def _record_shares(
    ctx: ControlContext, shares: dict[str, float], knobs: dict[str, float], reason: str
) -> None:
    if ctx.db_engine is None:
        return
    from tokenfleet.service.db import session_scope
    from tokenfleet.service.queries import append_tier_share

    try:
        with session_scope(ctx.db_engine) as session:
            for tier, share in shares.items():
                thr = knobs.get("reject_factor") if tier == "long_context" else None
                append_tier_share(session, tier, share, admission_threshold=thr, reason=reason)
    except Exception as exc:  # noqa: BLE001
        log.warning("tier shares not recorded: %s", exc.__class__.__name__)


def fleet_cycle() -> dict[str, Any]:
    """The FleetMind long cycle over the last ``fleet_period_s``.

    Inputs: live instances (ready) and the replicas a local actuator is
    prewarming (Redis), per-pool served and refused work from the ledger,
    spilled-in counts from the gateways' counters, the topology. Outputs, in
    Redis ``fleet``: the plan's spill shares (the gateways read them every
    second) and replica targets ``target:<dc>|<model>|<version>`` (enacted
    by ``tokenfleet up``'s actuator; a cluster manager can read the same
    keys). Plans and rollbacks also go to the ``fleet_events`` table.
    """
    from tokenfleet.core.fleet import Plan, Planner
    from tokenfleet.live.dc_select import LivePool, planner_input

    ctx = _ctx()
    st = ctx.state
    now = time.time()
    period = ctx.live.fleet_period_s
    topo = ctx.topology
    infos = [i for i in st.instances() if i.is_live(now, ctx.live.stale_after_s)]
    fleet = {k.decode(): v.decode() for k, v in st.r.hgetall(st.k("fleet")).items()}
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for i in infos:
        groups.setdefault((i.dc, i.model, i.model_version or ""), []).append(i)
    for key, v in fleet.items():  # pools with replicas still prewarming, none ready yet
        if key.startswith("warming:") and int(v or 0) > 0:
            dc, model, version = key.removeprefix("warming:").split("|")
            groups.setdefault((dc, model, version), [])
    pools = []
    for (dc, model, version), members in sorted(groups.items()):
        prof_name = (
            members[0].profile if members else fleet.get(f"profile:{dc}|{model}|{version}", "")
        )
        if not prof_name:
            continue
        pools.append(
            LivePool(
                dc,
                model,
                version,
                st.profile(prof_name),
                ready=sum(1 for m in members if m.is_healthy(now, ctx.live.stale_after_s)),
                warming=int(fleet.get(f"warming:{dc}|{model}|{version}", 0)),
            )
        )
    work = _ledger_work(ctx, now - period, now)
    counters = st.counters()
    prev_raw = st.r.get(st.k("fleet", "prev"))
    prev = json.loads(prev_raw) if prev_raw else {}
    spilled = {}
    for name, v in counters.items():
        if name.startswith("spilled_in:"):
            dc = name.partition(":")[2]
            spilled[dc] = max(0, v - int(prev.get(name, 0)))
    st.r.set(
        st.k("fleet", "prev"),
        json.dumps({k: v for k, v in counters.items() if k.startswith("spilled_in:")}),
    )
    inp = planner_input(now, period, pools, work, spilled, topo)
    if ctx.planner is None:
        initial = Plan(
            plan_id=0,
            at_s=now,
            replicas={(p.dc, p.model, p.version): p.replicas for p in inp.pools},
            spill_share={dc: 1.0 for dc in inp.dcs},
            reason="as deployed",
        )
        ctx.planner = Planner(initial=initial, rtt_s=_rtt_of(topo))
    plan, rollbacks = ctx.planner.step(inp)
    mapping: dict[str, Any] = {f"spill_share:{dc}": v for dc, v in plan.spill_share.items()}
    mapping.update(
        {f"target:{dc}|{model}|{version}": n for (dc, model, version), n in plan.replicas.items()}
    )
    mapping.update({f"profile:{p.dc}|{p.model}|{p.version}": p.profile.name for p in pools})
    mapping.update({"plan_id": plan.plan_id, "at": now})
    st.r.hset(st.k("fleet"), mapping=mapping)
    st.count(fleet_cycles=1, fleet_rollbacks=len(rollbacks))
    actions = [
        f"{a.kind} {a.dc} {a.model} x{a.count} ({a.reason})"
        if a.kind != "spill_share"
        else f"spill_share {a.dc} -> {a.value:.2f} ({a.reason})"
        for a in plan.actions
    ]
    loads = {f"{p.dc}/{p.model}": round(p.demand_work_s, 3) for p in inp.pools}
    quiet = plan.plan_id == ctx.last_plan_id and not rollbacks
    log.log(
        logging.DEBUG if quiet else logging.INFO,
        "FleetMind cycle: plan %d (%s%s), %d rollbacks, demand work-s/s %s, actions: %s",
        plan.plan_id,
        plan.kind,
        ", new" if plan.plan_id != ctx.last_plan_id else "",
        len(rollbacks),
        loads,
        actions or "none",
    )
    new_plan = plan.plan_id != ctx.last_plan_id
    ctx.last_plan_id = plan.plan_id
    if ctx.db_engine is not None and new_plan and (plan.actions or rollbacks):
        try:
            from tokenfleet.service.db import session_scope
            from tokenfleet.service.queries import append_fleet_event

            with session_scope(ctx.db_engine) as session:
                append_fleet_event(
                    session,
                    "rollback" if rollbacks else "plan",
                    {
                        "plan_id": plan.plan_id,
                        "actions": actions,
                        "spill_share": dict(plan.spill_share),
                        "replicas": {"|".join(k): v for k, v in plan.replicas.items()},
                    },
                )
        except Exception as exc:  # noqa: BLE001
            log.warning("fleet event not recorded: %s", exc.__class__.__name__)
    return {"plan_id": plan.plan_id, "rollbacks": len(rollbacks), "actions": actions}


def _ledger_work(ctx: ControlContext, since: float, until: float) -> list[Any]:
    if ctx.db_engine is None:
        return []
    from tokenfleet.service.queries import pool_work

    try:
        return pool_work(
            ctx.db_engine,
            since=datetime.fromtimestamp(since, UTC),
            until=datetime.fromtimestamp(until, UTC),
        )
    except Exception as exc:  # noqa: BLE001 - the database may blip; plan without it
        log.warning("ledger unavailable for the fleet cycle: %s", exc.__class__.__name__)
        return []


def _rtt_of(topo: Any) -> Any:
    """The topology's RTTs for the planner (50 ms between DCs it does not know)."""

    def rtt(a: str, b: str) -> float:
        if a == b:
            return 0.0
        if topo is not None and (a, b) in topo.rtt_s:
            return float(topo.rtt_s[(a, b)])
        return 0.05

    return rtt


def reconcile_ledger() -> dict[str, Any]:
    """Settle ledger rows left ``in_flight`` that nothing serves any more
    (:mod:`tokenfleet.live.reconcile`); a no-op without a ledger."""
    ctx = _ctx()
    if ctx.db_engine is None:
        return {}
    from tokenfleet.live.reconcile import reconcile

    try:
        report = reconcile(
            ctx.db_engine,
            ctx.state,
            request_timeout_s=ctx.live.request_timeout_s,
            grace_s=ctx.live.reconcile_grace_s,
            stream_ttl_s=ctx.live.stream_ttl_s,
        )
    except Exception as exc:  # noqa: BLE001 - a store down: the next pass retries
        log.warning("ledger reconciler skipped: %s", exc.__class__.__name__)
        return {}
    return {"examined": report.examined, "settled": report.settled}


def beat_schedule(live: LiveConfig) -> dict[str, Any]:
    from tokenfleet.live.jobs import TASK_CONTROL, TASK_FLEET, TASK_RECONCILE
    from tokenfleet.live.queues import CONTROL_QUEUE

    opts = {
        "queue": CONTROL_QUEUE,
        "routing_key": CONTROL_QUEUE,
        "expires": max(1.0, live.control_period_s),
    }
    return {
        "slomax-control": {
            "task": TASK_CONTROL,
            "schedule": timedelta(seconds=live.control_period_s),
            "options": opts,
        },
        "fleetmind-cycle": {
            "task": TASK_FLEET,
            "schedule": timedelta(seconds=live.fleet_period_s),
            "options": {**opts, "expires": live.fleet_period_s},
        },
        "ledger-reconcile": {
            "task": TASK_RECONCILE,
            "schedule": timedelta(seconds=live.reconcile_period_s),
            "options": {**opts, "expires": live.reconcile_period_s},
        },
    }
