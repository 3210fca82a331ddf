"""Read-side queries over the ledger and small write helpers for admin tables.

Definitions (window = requests whose ``arrival_ts`` is in ``[since, until)``):

* **goodput** — requests that finished within their SLO (status ``completed``)
  per second of window, and their completion tokens per second. Goodput, not
  throughput, is what the scheduler optimises (DistServe, OSDI'24, defines it
  as the rate of requests that meet their SLO).
* **attainment** — ``completed / eligible`` where eligible excludes requests
  the client cancelled, ``duplicate`` submissions and those still
  ``in_flight``; rejected, failed, timed-out and SLO-missed requests count
  against it, because from the tenant's view they did not get served in time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from tokenfleet.service.ledger import (
    ApiKey,
    AuditLog,
    FleetEvent,
    FleetEventKind,
    RequestRow,
    RequestStatus,
    Tenant,
    TierShare,
    generate_api_key,
    hash_api_key,
    utcnow,
)

GroupBy = Literal["tier", "tenant", "dc", "model", "all"]
_GROUP_COLUMNS = {
    "tier": RequestRow.tier,
    "tenant": RequestRow.tenant_id,
    "dc": RequestRow.dc,
    "model": RequestRow.model,
}
_EXCLUDED = (RequestStatus.CANCELLED, RequestStatus.DUPLICATE, RequestStatus.IN_FLIGHT)


@dataclass(frozen=True)
class GoodputRow:
    key: str | None  # group value; None for group_by="all" (or a NULL dc)
    total: int
    completed: int
    slo_missed: int
    failed: int
    timed_out: int
    rejected: int
    cancelled: int
    window_s: float
    goodput_rps: float
    goodput_tokens_per_s: float
    attainment: float | None  # None when no eligible request


def _mappings(bind: Engine | Connection | Session, stmt: Any) -> Sequence[Any]:
    """Run a SELECT on an engine (own connection), connection or session."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return conn.execute(stmt).mappings().all()
    return bind.execute(stmt).mappings().all()


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def goodput(
    bind: Engine | Connection | Session,
    *,
    since: datetime,
    until: datetime,
    group_by: GroupBy = "tier",
) -> list[GoodputRow]:
    """Goodput and SLO attainment per ``group_by`` for arrivals in ``[since, until)``."""
    since, until = _utc(since), _utc(until)
    window_s = (until - since).total_seconds()
    if window_s <= 0:
        raise ValueError("goodput window must have until > since")

    def count(*statuses: RequestStatus) -> Any:
        return sa.func.coalesce(
            sa.func.sum(sa.case((RequestRow.status.in_([s.value for s in statuses]), 1), else_=0)),
            0,
        )

    done_tokens = sa.func.coalesce(
        sa.func.sum(
            sa.case(
                (RequestRow.status == RequestStatus.COMPLETED.value, RequestRow.completion_tokens),
                else_=0,
            )
        ),
        0,
    )
    cols = [
        sa.func.count().label("total"),
        count(RequestStatus.COMPLETED).label("completed"),
        count(RequestStatus.SLO_MISSED).label("slo_missed"),
        count(RequestStatus.FAILED).label("failed"),
        count(RequestStatus.TIMED_OUT).label("timed_out"),
        count(RequestStatus.REJECTED).label("rejected"),
        count(RequestStatus.CANCELLED).label("cancelled"),
        count(*_EXCLUDED).label("excluded"),
        done_tokens.label("tokens"),
    ]
    key_col = _GROUP_COLUMNS.get(group_by) if group_by != "all" else None
    if group_by != "all" and key_col is None:
        raise ValueError(f"group_by must be one of: {', '.join([*_GROUP_COLUMNS, 'all'])}")
    stmt = sa.select(*([key_col.label("key")] if key_col is not None else []), *cols).where(
        RequestRow.arrival_ts >= since, RequestRow.arrival_ts < until
    )
    if key_col is not None:
        stmt = stmt.group_by(key_col).order_by(key_col)

    result = _mappings(bind, stmt)

    rows = []
    for r in result:
        eligible = int(r["total"]) - int(r["excluded"])
        completed = int(r["completed"])
        rows.append(
            GoodputRow(
                key=r.get("key"),
                total=int(r["total"]),
                completed=completed,
                slo_missed=int(r["slo_missed"]),
                failed=int(r["failed"]),
                timed_out=int(r["timed_out"]),
                rejected=int(r["rejected"]),
                cancelled=int(r["cancelled"]),
                window_s=window_s,
                goodput_rps=completed / window_s,
                goodput_tokens_per_s=int(r["tokens"]) / window_s,
                attainment=completed / eligible if eligible > 0 else None,
            )
        )
    if group_by == "all" and rows and rows[0].total == 0:
        return []
    return rows


@dataclass(frozen=True)
class PoolWorkRow:
    """What one (DC, model, version) pool did in a window: the planner's input."""

    dc: str | None
    model: str
    version: str
    served: int  # finished there (any status but rejected/duplicate/in flight)
    slo_met: int  # of those, completed within their SLO
    uncached_prompt_tokens: int  # of served requests
    completion_tokens: int
    rejected: int  # refused at admission while this DC was chosen
    rejected_prompt_tokens: int


def pool_work(
    bind: Engine | Connection | Session, *, since: datetime, until: datetime
) -> list[PoolWorkRow]:
    """Per-pool served and refused work for arrivals in ``[since, until)``."""
    since, until = _utc(since), _utc(until)
    served_statuses = [
        s.value
        for s in (
            RequestStatus.COMPLETED,
            RequestStatus.SLO_MISSED,
            RequestStatus.FAILED,
            RequestStatus.TIMED_OUT,
            RequestStatus.CANCELLED,
        )
    ]
    is_served = RequestRow.status.in_(served_statuses)
    is_rejected = RequestRow.status == RequestStatus.REJECTED.value

    def total(cond: Any, value: Any) -> Any:
        return sa.func.coalesce(sa.func.sum(sa.case((cond, value), else_=0)), 0)

    version = sa.func.coalesce(RequestRow.model_version, "")
    stmt = (
        sa.select(
            RequestRow.dc,
            RequestRow.model,
            version.label("version"),
            total(is_served, 1).label("served"),
            total(RequestRow.status == RequestStatus.COMPLETED.value, 1).label("slo_met"),
            total(is_served, RequestRow.prompt_tokens - RequestRow.cached_tokens).label("uncached"),
            total(is_served, RequestRow.completion_tokens).label("completion"),
            total(is_rejected, 1).label("rejected"),
            total(is_rejected, RequestRow.prompt_tokens).label("rejected_prompt"),
        )
        .where(RequestRow.arrival_ts >= since, RequestRow.arrival_ts < until)
        .group_by(RequestRow.dc, RequestRow.model, version)
        .order_by(RequestRow.dc, RequestRow.model)
    )
    result = _mappings(bind, stmt)
    return [
        PoolWorkRow(
            dc=r["dc"],
            model=r["model"],
            version=r["version"],
            served=int(r["served"]),
            slo_met=int(r["slo_met"]),
            uncached_prompt_tokens=max(0, int(r["uncached"])),
            completion_tokens=int(r["completion"]),
            rejected=int(r["rejected"]),
            rejected_prompt_tokens=int(r["rejected_prompt"]),
        )
        for r in result
    ]


# ---- admin-side helpers (one Session, caller commits) --------------------------
def create_tenant(
    session: Session,
    tenant_id: str,
    *,
    name: str | None = None,
    slo_class: str = "standard",
    allowed_models: Sequence[str] = (),
    allowed_regions: Sequence[str] = (),
    **quotas: int | None,
) -> Tenant:
    tenant = Tenant(
        id=tenant_id,
        name=name or tenant_id,
        slo_class=slo_class,
        allowed_models=list(allowed_models),
        allowed_regions=list(allowed_regions),
        **quotas,
    )
    session.add(tenant)
    return tenant


def create_api_key(session: Session, tenant_id: str, *, name: str | None = None) -> str:
    """Store a new key's hash and return the plaintext (shown once, never stored)."""
    plaintext, digest, prefix = generate_api_key()
    session.add(ApiKey(tenant_id=tenant_id, key_sha256=digest, prefix=prefix, name=name))
    return plaintext


def lookup_api_key(session: Session, plaintext: str) -> Tenant | None:
    """The tenant owning an active (not revoked, tenant not disabled) key, else None."""
    stmt = (
        sa.select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_sha256 == hash_api_key(plaintext), ApiKey.revoked_at.is_(None))
        .where(Tenant.disabled.is_(False))
    )
    return session.execute(stmt).scalar_one_or_none()


def revoke_api_key(session: Session, plaintext_or_prefix: str) -> int:
    """Revoke by full key or by display prefix; returns how many keys were revoked."""
    cond = sa.or_(
        ApiKey.key_sha256 == hash_api_key(plaintext_or_prefix), ApiKey.prefix == plaintext_or_prefix
    )
    result = session.execute(
        sa.update(ApiKey).where(cond, ApiKey.revoked_at.is_(None)).values(revoked_at=utcnow())
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def append_audit(
    session: Session, actor: str, action: str, payload: dict[str, Any] | None = None
) -> None:
    session.add(AuditLog(actor=actor, action=action, payload=payload or {}))


def append_tier_share(
    session: Session,
    tier: str,
    share: float,
    *,
    admission_threshold: float | None = None,
    reason: str | None = None,
    ts: datetime | None = None,
) -> None:
    session.add(
        TierShare(
            tier=tier,
            share=share,
            admission_threshold=admission_threshold,
            reason=reason,
            ts=ts or utcnow(),
        )
    )


def append_fleet_event(
    session: Session,
    kind: FleetEventKind | str,
    payload: dict[str, Any],
    *,
    ts: datetime | None = None,
) -> None:
    session.add(FleetEvent(kind=FleetEventKind(kind), payload=payload, ts=ts or utcnow()))
