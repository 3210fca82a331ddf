"""Per-tenant usage counters: buffered in Redis, flushed to PostgreSQL in bulk.

Recording a request is one pipelined ``HINCRBY`` batch on a Redis hash (so a
crashed API process loses nothing it recorded). A flusher (a thread in every
API process and the batch runner; any number may run) atomically ``RENAME``s
the hash away, so each flush owns a disjoint set of increments, and writes
them as one additive ``INSERT .. ON CONFLICT DO UPDATE SET x = x + excluded.x``
with one row per (tenant, budget, UTC day): a thousand requests in a flush
interval cost one row write per tenant, not a thousand.

A claimed hash is named with its claim time. A flusher takes over another's
claimed hash only once it is older than :data:`ABANDONED_AFTER_S` (its owner
died after the RENAME), and renames it again first, so one flusher wins: a
hash that another flusher is still writing is never written twice. Flushes in
one process run one at a time.

A flush that dies between the database commit and deleting its Redis hash
would replay those increments on the next flush; the window is one DEL, and
the usage table is an operational view, not the billing ledger (that is the
per-request ``requests`` table).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import UTC, date, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.service.ledger import utcnow
from tokenfleet.tenancy.models import TenantUsage
from tokenfleet.tenancy.quota import BUDGETS

log = logging.getLogger("tokenfleet.usage")

METRICS = ("requests", "rejected", "prompt_tokens", "completion_tokens")
#: a claimed hash this old belongs to a flusher that died: another one takes it over
ABANDONED_AFTER_S = 60.0


class UsageRecorder:
    def __init__(
        self, redis_client: Any, engine: Engine | None = None, *, prefix: str = "tf"
    ) -> None:
        self.redis = redis_client
        self.engine = engine
        self.pending_key = f"{prefix}:usage:pending"
        self.flushing_prefix = f"{prefix}:usage:flushing:"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flush_lock = threading.Lock()

    def record(
        self,
        tenant_id: str,
        budget: str,
        *,
        requests: int = 0,
        rejected: int = 0,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        day: date | None = None,
    ) -> None:
        if budget not in BUDGETS:
            raise ValueError(f"unknown budget '{budget}'")
        d = (day or datetime.now(UTC).date()).isoformat()
        pipe = self.redis.pipeline(transaction=False)
        for name, value in (
            ("requests", requests),
            ("rejected", rejected),
            ("prompt_tokens", prompt_tokens),
            ("completion_tokens", completion_tokens),
        ):
            if value:
                pipe.hincrby(self.pending_key, f"{tenant_id}|{budget}|{d}|{name}", int(value))
        pipe.execute()

    def flush(self) -> int:
        """Move buffered increments to PostgreSQL; returns the rows upserted."""
        if self.engine is None:
            raise RuntimeError("UsageRecorder needs an engine to flush")
        with self._flush_lock:
            rows = 0
            # leftovers of a flusher that died after RENAME come first
            now = time.time()
            for key in list(self.redis.scan_iter(match=self.flushing_prefix + "*", count=100)):
                if now - self._claimed_at(key) < ABANDONED_AFTER_S:
                    continue  # another flusher is writing it now
                mine = self._claim(key)
                if mine is not None:
                    rows += self._flush_key(mine)
            mine = self._claim(self.pending_key)
            return rows if mine is None else rows + self._flush_key(mine)

    def _claim(self, key: Any) -> str | None:
        """RENAME ``key`` to a claimed name of this flush (None: nothing there, or
        another flusher renamed it first)."""
        claimed = f"{self.flushing_prefix}{time.time():.3f}:{uuid.uuid4().hex}"
        try:
            self.redis.rename(key, claimed)
        except Exception as exc:
            if "no such key" in str(exc).lower():
                return None
            raise
        return claimed

    def _claimed_at(self, key: Any) -> float:
        """Claim time in a claimed hash's name (0 for names without one: abandoned)."""
        name = key.decode() if isinstance(key, bytes) else str(key)
        stamp = name[len(self.flushing_prefix) :].partition(":")[0]
        try:
            return float(stamp)
        except ValueError:
            return 0.0

    def _flush_key(self, key: Any) -> int:
        raw = self.redis.hgetall(key)
        agg: dict[tuple[str, str, str], dict[str, int]] = {}
        for field, value in raw.items():
            tenant_id, budget, d, metric = field.decode().split("|")
            agg.setdefault((tenant_id, budget, d), dict.fromkeys(METRICS, 0))[metric] += int(value)
        if agg:
            now = utcnow()
            values = [
                {"tenant_id": t, "budget": b, "day": date.fromisoformat(d), **m, "updated_at": now}
                for (t, b, d), m in sorted(agg.items())
            ]
            with self.engine.begin() as conn:  # type: ignore[union-attr]
                conn.execute(_upsert(conn.dialect.name), values)
        self.redis.delete(key)
        return len(agg)

    # ---- background flusher -------------------------------------------------------
    def start(self, interval_s: float = 2.0) -> None:
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.flush()
                except Exception as exc:  # noqa: BLE001 - retried next interval; counters stay in Redis
                    log.warning("usage flush failed (kept in Redis, retrying): %s", exc)

        self._thread = threading.Thread(target=loop, name="usage-flusher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            if self.engine is not None:
                self.flush()
        except Exception as exc:  # noqa: BLE001
            log.warning("final usage flush failed (kept in Redis): %s", exc)


def _upsert(dialect: str) -> Any:
    table: sa.Table = TenantUsage.__table__  # type: ignore[assignment]
    insert: Any
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    stmt = insert(table)
    ex = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[table.c.tenant_id, table.c.budget, table.c.day],
        set_={**{m: table.c[m] + ex[m] for m in METRICS}, "updated_at": ex.updated_at},
    )


def usage_for(engine: Engine, tenant_id: str, *, since: date | None = None) -> list[dict[str, Any]]:
    """Flushed per-day usage of one tenant (newest first)."""
    stmt = sa.select(TenantUsage).where(TenantUsage.tenant_id == tenant_id)
    if since is not None:
        stmt = stmt.where(TenantUsage.day >= since)
    stmt = stmt.order_by(TenantUsage.day.desc(), TenantUsage.budget)
    with engine.connect() as conn:
        return [
            {
                "day": r.day.isoformat(),
                "budget": r.budget,
                **{m: int(getattr(r, m)) for m in METRICS},
            }
            for r in conn.execute(stmt)
        ]
