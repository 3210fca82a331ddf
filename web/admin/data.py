"""What the admin dashboard shows, read from the ledger and the live state.

Ledger series (per tier, per minute over the last ``window_s``): goodput
(requests finished within SLO per second) and attainment (see
``tokenfleet.service.queries`` for the definitions). Live state (from Redis,
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


def tier_series(
    engine: Engine, *, window_s: float = 1800.0, bucket_s: int = 60, now: datetime | None = None
) -> dict[str, dict[str, list[tuple[float, float | None]]]]:
    """{"goodput": {tier: [(t, rps)]}, "attainment": {tier: [(t, 0..1 or None)]}}."""
    until = now or datetime.now(UTC)
    since = until - timedelta(seconds=window_s)
    bucket = sa.func.floor(sa.extract("epoch", RequestRow.arrival_ts) / bucket_s)
    completed = sa.func.sum(
        sa.case((RequestRow.status == RequestStatus.COMPLETED.value, 1), else_=0)
    )
    eligible = sa.func.sum(sa.case((RequestRow.status.in_(_EXCLUDED), 0), else_=1))
    stmt = (
        sa.select(RequestRow.tier, bucket.label("b"), completed.label("c"), eligible.label("e"))
        .where(RequestRow.arrival_ts >= since, RequestRow.arrival_ts < until)
        .group_by(RequestRow.tier, bucket)
        .order_by(bucket)
    )
    good: dict[str, list[tuple[float, float | None]]] = {}
    att: dict[str, list[tuple[float, float | None]]] = {}
    with engine.connect() as conn:
        for tier, b, c, e in conn.execute(stmt):
            t = float(b) * bucket_s + bucket_s / 2
            good.setdefault(tier, []).append((t, int(c or 0) / bucket_s))
            att.setdefault(tier, []).append((t, (int(c or 0) / int(e)) if e else None))
    return {"goodput": good, "attainment": att}


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
