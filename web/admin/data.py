"""What the admin dashboard shows, read from the ledger and the live state.

Ledger series (per tier, per minute over the last ``window_s``): goodput
(output tokens per second of requests that finished within their SLO, the
product's definition), attainment (share of requests within SLO, in %) and
output tokens per second of every completed request, for the whole fleet or
one tenant. Live state (from Redis,
when this process has the live path): instances and health, tier shares and
admission knobs, queue depth per tier, sampled every few seconds by
:class:`QueueSampler` so the chart has history.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.service.ledger import FleetEvent, RequestRow, RequestStatus, TierShare

_EXCLUDED = [
    RequestStatus.CANCELLED.value,
    RequestStatus.DUPLICATE.value,
    RequestStatus.IN_FLIGHT.value,
]


Series = dict[str, list[tuple[float, float | None]]]


def tier_series(
    engine: Engine,
    *,
    window_s: float = 1800.0,
    bucket_s: int = 60,
    now: datetime | None = None,
    tenant: str | None = None,
) -> dict[str, Series]:
    """Per tier, one point per ``bucket_s`` of arrivals: ``goodput`` (output
    tokens/s within SLO), ``attainment`` (% within SLO) and ``output`` (output
    tokens/s of all completed requests); only ``tenant``'s requests if given."""
    until = now or datetime.now(UTC)
    since = until - timedelta(seconds=window_s)
    bucket = sa.func.floor(sa.extract("epoch", RequestRow.arrival_ts) / bucket_s)
    met = RequestRow.status == RequestStatus.COMPLETED.value
    done = RequestRow.status.in_([RequestStatus.COMPLETED.value, RequestStatus.SLO_MISSED.value])
    completed = sa.func.sum(sa.case((met, 1), else_=0))
    good_tokens = sa.func.sum(sa.case((met, RequestRow.completion_tokens), else_=0))
    all_tokens = sa.func.sum(sa.case((done, RequestRow.completion_tokens), else_=0))
    eligible = sa.func.sum(sa.case((RequestRow.status.in_(_EXCLUDED), 0), else_=1))
    stmt = (
        sa.select(
            RequestRow.tier,
            bucket.label("b"),
            completed.label("c"),
            eligible.label("e"),
            good_tokens.label("g"),
            all_tokens.label("o"),
        )
        .where(RequestRow.arrival_ts >= since, RequestRow.arrival_ts < until)
        .group_by(RequestRow.tier, bucket)
        .order_by(bucket)
    )
    if tenant is not None:
        stmt = stmt.where(RequestRow.tenant_id == tenant)
    good: Series = {}
    att: Series = {}
    out: Series = {}
    with engine.connect() as conn:
        for tier, b, c, e, g, o in conn.execute(stmt):
            t = float(b) * bucket_s + bucket_s / 2
            good.setdefault(tier, []).append((t, int(g or 0) / bucket_s))
            out.setdefault(tier, []).append((t, int(o or 0) / bucket_s))
            att.setdefault(tier, []).append((t, (100.0 * int(c or 0) / int(e)) if e else None))
    return {"goodput": good, "attainment": att, "output": out}


def share_history(engine: Engine, *, limit: int = 15, scan: int = 2000) -> list[dict[str, Any]]:
    """The controller's most recent share *changes*, newest first.

    Beat records every tick; a row is a change when its share or knob differs
    from the previous row of the same tier.
    """
    with engine.connect() as conn:
        rows = list(conn.execute(sa.select(TierShare).order_by(TierShare.id.desc()).limit(scan)))
    out: list[dict[str, Any]] = []
    for i, r in enumerate(rows):
        prev = next((p for p in rows[i + 1 :] if p.tier == r.tier), None)
        if (
            prev is not None
            and prev.share == r.share
            and prev.admission_threshold == r.admission_threshold
        ):
            continue
        out.append(
            {
                "ts": r.ts,
                "tier": r.tier,
                "share": r.share,
                "threshold": r.admission_threshold,
                "reason": r.reason,
                "from_share": None if prev is None else prev.share,
            }
        )
        if len(out) >= limit:
            break
    return out


def fleet_events(engine: Engine, *, limit: int = 15) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(FleetEvent).order_by(FleetEvent.id.desc()).limit(limit))
        return [
            {"ts": r.ts, "kind": getattr(r.kind, "value", r.kind), "payload": r.payload}
            for r in rows
        ]


@dataclass
class LiveView:
    available: bool
    instances: list[dict[str, Any]] = field(default_factory=list)
    shares: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float | None] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)
    error: str = ""


def live_view(gateway: Any) -> LiveView:
    if gateway is None:
        return LiveView(False, error="this process does not run the live request path")
    st = gateway.state
    try:
        infos = st.instances()
        shares = st.shares()
        thresholds = st.thresholds()
        queued = st.queued()
    except Exception as exc:  # noqa: BLE001 - show the page anyway
        return LiveView(False, error=f"live state store unavailable ({exc.__class__.__name__})")
    now = time.time()
    stale = gateway.live.stale_after_s
    by_tier: dict[str, int] = {}
    for q, n in queued.items():
        tier = q.rsplit(".", 1)[-1]
        by_tier[tier] = by_tier.get(tier, 0) + n
    rows = []
    for i in sorted(infos, key=lambda i: (i.dc, i.instance_id)):
        rows.append(
            {
                "dc": i.dc,
                "id": i.instance_id,
                "model": i.model,
                "healthy": i.is_healthy(now, stale),
                "live": i.is_live(now, stale),
                "age_s": max(0.0, i.age_s(now)),
                "running": i.metrics.num_running,
                "waiting": i.metrics.num_waiting,
                "kv": i.metrics.kv_usage,
                "slots": i.slots,
                "reason": i.unhealthy_reason,
                "by_tier": dict(i.running_by_tier),
            }
        )
    return LiveView(True, rows, shares, thresholds, by_tier)


class QueueSampler:
    """Queue depth per tier every ``period_s`` (in memory, last ``keep`` samples)."""

    def __init__(self, gateway: Any, period_s: float = 3.0, keep: int = 600) -> None:
        self.gateway = gateway
        self.period_s = period_s
        self.samples: deque[tuple[float, dict[str, int]]] = deque(maxlen=keep)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="queue-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> None:
        view = live_view(self.gateway)
        if view.available:
            self.samples.append((time.time(), dict(view.queued)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def series(self) -> dict[str, list[tuple[float, float | None]]]:
        tiers = sorted({t for _, q in self.samples for t in q} | {"interactive", "batch"})
        return {t: [(ts, float(q.get(t, 0))) for ts, q in self.samples] for t in tiers}


def models_view(gateway: Any) -> list[dict[str, Any]]:
    """One row per (model, version, DC): deployed by the topology and/or served by
    live instances, with how many instances are healthy (ready) out of how many."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}

    def row(model: str, version: str, dc: str) -> dict[str, Any]:
        key = (model, version or "-", dc)
        if key not in rows:
            rows[key] = {
                "model": model,
                "version": version or "-",
                "dc": dc,
                "region": "",
                "deployed": 0,
                "profile": "",
                "instances": 0,
                "healthy": 0,
            }
        return rows[key]

    if gateway is None:
        return []
    selector = getattr(gateway, "dc_selector", None)
    topo = getattr(selector, "topology", None)
    for name, dc in (getattr(topo, "datacenters", None) or {}).items():
        for d in dc.deployments:
            r = row(d.model, d.version, name)
            r.update(region=dc.region, deployed=d.instances, profile=d.profile)
    now = time.time()
    for i in gateway.state.instances():
        r = row(i.model, i.model_version, i.dc)
        r["instances"] += 1
        r["healthy"] += 1 if i.is_healthy(now, gateway.live.stale_after_s) else 0
    return [rows[k] for k in sorted(rows)]
