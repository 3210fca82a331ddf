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
  live instances; the resulting spill shares are written to Redis and the
  plan to ``fleet_events``. Replica changes are logged as recommendations:
  ``tokenfleet up`` runs a fixed topology and has nothing to scale.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
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
    prev = json.loads(raw) if raw else {"at": now - ctx.live.control_period_s, "c": {}}
    pc: dict[str, int] = prev["c"]
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
    ledger = _ledger_goodput(ctx, now - period, now, "tier")
    summary = {t: (w.met, w.finished) for t, w in win.tiers.items() if w.finished or w.arrivals}
    log.info("SLOMax tick: %s | window %.1fs met/finished %s | ledger goodput %s",
             ctrl.last_reason, period, summary, ledger)
    _record_shares(ctx, shares, knobs.as_dict(), ctrl.last_reason)
    return {"knobs": knobs.as_dict(), "reason": ctrl.last_reason, "window": summary}


def _ledger_goodput(ctx: ControlContext, since: float, until: float,
                    group_by: str) -> dict[str, Any]:
    if ctx.db_engine is None:
        return {}
    from tokenfleet.service.queries import goodput

    try:
        rows = goodput(ctx.db_engine, since=datetime.fromtimestamp(since, timezone.utc),
                       until=datetime.fromtimestamp(until, timezone.utc),
                       group_by=group_by)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - the database may blip; control goes on
        log.warning("ledger unavailable for the control loop: %s", exc.__class__.__name__)
        return {}
    return {str(r.key): {"goodput_rps": round(r.goodput_rps, 3),
                         "attainment": r.attainment, "total": r.total} for r in rows}


def _record_shares(ctx: ControlContext, shares: dict[str, float], knobs: dict[str, float],
                   reason: str) -> None:
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
    from tokenfleet.core.fleet import DCStats, Plan, Planner, PlannerInput, PoolStats

    ctx = _ctx()
    st = ctx.state
    now = time.time()
    infos = [i for i in st.instances() if i.is_live(now, ctx.live.stale_after_s)]
    period = ctx.live.fleet_period_s
    by_dc = _ledger_goodput(ctx, now - period, now, "dc")
    pools: dict[tuple[str, str, str], list[Any]] = {}
    for i in infos:
        pools.setdefault((i.dc, i.model, i.model_version or ""), []).append(i)
    pool_stats = []
    for (dc, model, version), members in sorted(pools.items()):
        load = sum(min(1.0, i.metrics.num_running / max(1, i.slots)) for i in members)
        pool_stats.append(PoolStats(dc=dc, model=model, version=version, tp=1,
                                    replicas=len(members), ready=len(members),
                                    demand_work_s=load, served_work_s=load,
                                    load=load / len(members)))
    dcs = {}
    for dc in sorted({i.dc for i in infos}):
        row = by_dc.get(dc, {})
        total = int(row.get("total", 0))
        att = row.get("attainment")
        met = int(round((att or 0.0) * total)) if att is not None else 0
        dcs[dc] = DCStats(dc=dc, served=total, slo_met=met, spilled_in=0,
                          target=_target_of(ctx.live, dc), free_gpus=0)
    if ctx.planner is None:
        initial = Plan(plan_id=0, at_s=now, replicas={(p.dc, p.model, p.version): p.replicas
                                                      for p in pool_stats},
                       spill_share={dc: 1.0 for dc in dcs})
        ctx.planner = Planner(initial=initial, rtt_s=_rtt_of(ctx.live))
    plan, rollbacks = ctx.planner.step(PlannerInput(now_s=now, pools=pool_stats, dcs=dcs,
                                                    gpu_budget=None,
                                                    gpus_used=len(infos)))
    st.r.hset(st.k("fleet"), mapping={f"spill_share:{dc}": v
                                      for dc, v in plan.spill_share.items()} or {"plan": 0})
    st.r.hset(st.k("fleet"), mapping={"plan_id": plan.plan_id, "at": now})
    st.count(fleet_cycles=1, fleet_rollbacks=len(rollbacks))
    actions = [f"{a.kind} {a.dc} {a.model} x{a.count} ({a.reason})" for a in plan.actions]
    log.info("FleetMind cycle: plan %d (%s), %d rollbacks, per-DC %s, actions: %s",
             plan.plan_id, plan.kind, len(rollbacks), by_dc, actions or "none")
    if ctx.db_engine is not None and (plan.actions or rollbacks):
        try:
            from tokenfleet.service.db import session_scope
            from tokenfleet.service.queries import append_fleet_event

            with session_scope(ctx.db_engine) as session:
                append_fleet_event(session, "rollback" if rollbacks else "plan",
                                   {"plan_id": plan.plan_id, "actions": actions,
                                    "spill_share": dict(plan.spill_share)})
        except Exception as exc:  # noqa: BLE001
            log.warning("fleet event not recorded: %s", exc.__class__.__name__)
    return {"plan_id": plan.plan_id, "rollbacks": len(rollbacks), "actions": actions}


def _topology(live: LiveConfig) -> Any:
    if not live.topology:
        return None
    from tokenfleet.live.fleet import load_topology

    return load_topology(live.topology)


def _rtt_of(live: LiveConfig) -> Any:
    """The topology's RTTs for the planner (50 ms between DCs it does not know)."""
    topo = _topology(live)

    def rtt(a: str, b: str) -> float:
        if a == b:
            return 0.0
        if topo is not None and (a, b) in topo.rtt_s:
            return float(topo.rtt_s[(a, b)])
        return 0.05

    return rtt


def _target_of(live: LiveConfig, dc: str) -> float:
    """The DC's attainment target from the topology, else the fleet default."""
    topo = _topology(live)
    if topo is None:
        return 0.95
    site = topo.datacenters.get(dc)
    if site is not None and site.attainment_target is not None:
        return site.attainment_target
    return topo.settings.attainment_target


def beat_schedule(live: LiveConfig) -> dict[str, Any]:
    from tokenfleet.live.queues import CONTROL_QUEUE
    from workers.app import TASK_CONTROL, TASK_FLEET

    opts = {"queue": CONTROL_QUEUE, "routing_key": CONTROL_QUEUE,
            "expires": max(1.0, live.control_period_s)}
    return {
        "slomax-control": {"task": TASK_CONTROL, "schedule": timedelta(
            seconds=live.control_period_s), "options": opts},
        "fleetmind-cycle": {"task": TASK_FLEET, "schedule": timedelta(
            seconds=live.fleet_period_s), "options": {**opts, "expires": live.fleet_period_s}},
    }
