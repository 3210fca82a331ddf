"""Ledger reconciler: no request stays ``in_flight`` once nothing serves it.

The worker and the API each record a request's end, so a row is normally
final within a flush interval. What neither can record: an API process that
died while it watched a request (with its writer's buffer), or a request
whose every writer was down at its end. Beat runs :func:`reconcile` every
``reconcile_period_s``; for each ledger row still ``in_flight`` (or holding
only a ``duplicate`` delivery) that arrived more than ``grace_s`` ago it asks
the live state (Redis) who owns the request:

* settled there (``done``): the row takes that final status, with the tokens
  and worker facts of the relay stream's ``end`` entry when it still exists;
* running with a live lease, or queued for less than the request timeout:
  someone still serves it, left alone;
* running without a lease (its worker died and no API re-sent it) for more
  than ``grace_s``, queued past the request timeout, or unknown to Redis
  (restarted without it): settled ``failed`` in Redis (so a late delivery
  is refused, and a reader still attached gets an error event) and in the
  ledger, with the tokens the relay stream shows the client was sent.

Rows are written with the writer's upsert, so its precedence rule holds: a
worker's spilled ``completed`` row replayed later still wins over a
reconciled ``failed``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.live.relay import RelayWriter
from tokenfleet.live.state import LiveState
from tokenfleet.service.ledger import RequestRow, RequestStatus, utcnow
from tokenfleet.service.writer import RequestRecord, normalize_row, upsert_statement

log = logging.getLogger("tokenfleet.reconcile")

#: statuses a row may hold while its request has no final row yet
OPEN_STATUSES = (RequestStatus.IN_FLIGHT.value, RequestStatus.DUPLICATE.value)
SERVED = (RequestStatus.COMPLETED.value, RequestStatus.SLO_MISSED.value)


@dataclass
class ReconcileReport:
    examined: int = 0
    settled: dict[str, int] = field(default_factory=dict)  # final status -> rows written
    alive: int = 0  # still served (lease or queue), left alone
    watching: int = 0  # lease just lapsed: looked at again next pass

    @property
    def written(self) -> int:
        return sum(self.settled.values())


@dataclass
class _Stream:
    """What a request's relay stream shows: tokens sent, and its end entry."""

    tokens: int = 0
    first_token_ts: float | None = None
    end: dict[str, str] | None = None
    usage: dict[str, Any] | None = None


def _read_stream(state: LiveState, rid: str) -> _Stream:
    out = _Stream()
    entries: list[tuple[bytes, dict[bytes, bytes]]] = state.r.xrange(state.stream_key(rid))  # type: ignore[assignment]
    for eid, raw in entries:
        fields = {k.decode(): v.decode("utf-8", "replace") for k, v in raw.items()}
        kind = fields.get("k", "")
        if kind == "d":
            out.tokens += int(fields.get("n") or 0)
            if out.first_token_ts is None:  # the entry id is its write time in ms
                out.first_token_ts = int(eid.decode().split("-")[0]) / 1000.0
        elif kind == "end":
            out.end = fields
            u = out.end.get("u")
            out.usage = json.loads(u) if u else None
    return out


def _f(raw: str | None) -> float | None:
    try:
        return float(raw) if raw not in (None, "", "None") else None
    except ValueError:
        return None


def reconcile(
    engine: Engine,
    state: LiveState,
    *,
    request_timeout_s: float,
    grace_s: float = 15.0,
    now_s: float | None = None,
    limit: int = 1000,
    stream_ttl_s: float = 120.0,
) -> ReconcileReport:
    """One pass over open ledger rows older than ``grace_s`` (see the module doc)."""
    now = time.time() if now_s is None else now_s
    cutoff = datetime.fromtimestamp(now - grace_s, tz=UTC)
    t = RequestRow.__table__
    stmt = (
        sa.select(
            t.c.request_id, t.c.tenant_id, t.c.tier, t.c.model, t.c.arrival_ts, t.c.prompt_tokens
        )
        .where(t.c.status.in_(OPEN_STATUSES), t.c.arrival_ts < cutoff)
        .order_by(t.c.arrival_ts)
        .limit(limit)
    )
    with engine.connect() as conn:
        open_rows = conn.execute(stmt).mappings().all()
    report = ReconcileReport(examined=len(open_rows))
    rows: list[RequestRecord] = []
    for r in open_rows:
        row = _reconcile_one(state, dict(r), now, request_timeout_s, grace_s, stream_ttl_s, report)
        if row is not None:
            rows.append(row)
            report.settled[str(row.status)] = report.settled.get(str(row.status), 0) + 1
    if rows:
        stamp = utcnow()
        values = [{**normalize_row(row), "updated_at": stamp} for row in rows]
        with engine.begin() as conn:
            conn.execute(upsert_statement(conn.dialect.name), values)
        log.warning(
            "ledger reconciler: %d open rows settled %s", report.written, dict(report.settled)
        )
    return report


def _reconcile_one(
    state: LiveState,
    r: dict[str, Any],
    now: float,
    request_timeout_s: float,
    grace_s: float,
    stream_ttl_s: float,
    report: ReconcileReport,
) -> RequestRecord | None:
    rid = str(r["request_id"])
    st = state.request_state(rid)
    status = st.get("status")
    why = ""
    if status == "done":
        return _row(r, st.get("final") or "failed", _read_stream(state, rid), "", now)
    if status == "running":
        if state.lease_alive(rid):
            report.alive += 1
            return None
        # the lease lapsed; the API watching it re-sends or settles it within a
        # lease period or two. Only one that stays unowned is an orphan.
        state.r.hsetnx(state.k("req", rid), "orphan_at", now)
        since = _f(state.request_state(rid).get("orphan_at")) or now
        if now - since < grace_s:
            report.watching += 1
            return None
        why = "its worker was lost and nothing re-sent or settled it"
    elif status == "queued":
        queued_at = _f(st.get("queued_at")) or 0.0
        if now - queued_at < request_timeout_s + grace_s:
            report.alive += 1
            return None
        why = "queued past the request timeout with nobody waiting for it"
    else:
        why = "the live state no longer knows it (Redis restarted without it)"
    message = f"reconciled: {why}"
    won, final = state.finish(
        rid,
        "failed",
        end_event=RelayWriter.error_fields(message + "; retry the request", 502),
        stream_ttl_s=stream_ttl_s,
    )
    return _row(r, "failed" if won else (final or "failed"), _read_stream(state, rid), message, now)


def _row(r: dict[str, Any], status: str, stream: _Stream, error: str, now: float) -> RequestRecord:
    """The final row from the relay stream: the worker's facts when its end is there."""
    end = stream.end or {}
    usage = stream.usage or {}
    if status in SERVED and end.get("s"):
        status = end["s"]
    return RequestRecord(
        request_id=r["request_id"],
        tenant_id=r["tenant_id"],
        tier=r["tier"],
        model=r["model"],
        status=status,
        arrival_ts=r["arrival_ts"],
        instance=end.get("i") or None,
        dispatched_ts=_f(end.get("td")),
        first_token_ts=_f(end.get("tf")) or stream.first_token_ts,
        finished_ts=_f(end.get("te")) or now,
        prompt_tokens=int(usage.get("prompt_tokens") or r.get("prompt_tokens") or 0),
        cached_tokens=int(end.get("ca") or 0),
        completion_tokens=int(usage.get("completion_tokens") or stream.tokens),
        error=error or None,
    )
