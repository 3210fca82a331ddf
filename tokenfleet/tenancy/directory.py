"""Who is calling: API key -> tenant, with caches that honour revocation within 1 s.

Lookups go local memory (``local_ttl_s``, 0.5 s by default) -> Redis
(``redis_ttl_s``) -> PostgreSQL. Every mutation (revoke, quota change,
disable) deletes the Redis entries it affects before returning, so after a
revoke the only stale copies are in the local memories of API processes,
which expire within ``local_ttl_s``: a revoked key stops working everywhere
within half a second without any cross-process messaging.

Only SHA-256 digests of keys are used as cache keys; plaintext keys never
reach Redis or the database.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.service.db import session_scope
from tokenfleet.service.ledger import ApiKey, Tenant, hash_api_key
from tokenfleet.tenancy.models import TenantQuota
from tokenfleet.tenancy.quota import BUDGETS, QuotaLimits, TenantQuotas

_MISSING = "-"
#: how often a process writes its keys' last use to the database
LAST_USED_EVERY_S = 60.0
log = logging.getLogger("tokenfleet.tenancy")


@dataclass(frozen=True, slots=True)
class TenantContext:
    """Everything the request path needs to know about a tenant, cacheable as JSON."""

    id: str
    name: str
    slo_class: str = "standard"
    allowed_models: tuple[str, ...] = ()
    allowed_regions: tuple[str, ...] = ()
    quotas: TenantQuotas = field(default_factory=TenantQuotas)
    disabled: bool = False
    #: the API key that authenticated this request and its own limits (set by
    #: :meth:`TenantDirectory.authenticate`; not part of the tenant's cached record)
    key_id: int | None = None
    key_limits: QuotaLimits | None = None

    def allows_model(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "name": self.name,
                "slo_class": self.slo_class,
                "allowed_models": list(self.allowed_models),
                "allowed_regions": list(self.allowed_regions),
                "quotas": self.quotas.as_dict(),
                "disabled": self.disabled,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TenantContext:
        d = json.loads(text)
        return cls(
            id=d["id"],
            name=d["name"],
            slo_class=d["slo_class"],
            allowed_models=tuple(d["allowed_models"]),
            allowed_regions=tuple(d["allowed_regions"]),
            quotas=TenantQuotas.from_mapping(d["quotas"]),
            disabled=bool(d["disabled"]),
        )


@dataclass(frozen=True, slots=True)
class _Key:
    """What the request path needs of an API key: its tenant, id and own limits."""

    tenant_id: str
    key_id: int
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def to_json(self) -> str:
        return json.dumps(
            [self.tenant_id, self.key_id, self.requests_per_minute, self.tokens_per_minute]
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> _Key:
        tenant_id, key_id, rpm, tpm = json.loads(raw)
        return cls(str(tenant_id), int(key_id), rpm, tpm)


def load_tenant(session: Any, tenant_id: str) -> TenantContext | None:
    """A tenant with its quotas from the database (None if unknown).

    Without a ``tenant_quotas`` row, the interactive budget falls back to the
    Tenant row's own limit columns (tenants made by ``tokenfleet db create-key``).
    """
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        return None
    rows = {
        r.budget: r
        for r in session.scalars(sa.select(TenantQuota).where(TenantQuota.tenant_id == tenant_id))
    }
    budgets: dict[str, QuotaLimits] = {}
    for b in BUDGETS:
        row = rows.get(b)
        if row is not None:
            budgets[b] = QuotaLimits(
                row.requests_per_minute,
                row.tokens_per_minute,
                row.max_concurrent_requests,
                row.daily_token_budget,
            )
        elif b == "interactive":
            budgets[b] = QuotaLimits(
                tenant.requests_per_minute,
                tenant.tokens_per_minute,
                tenant.max_concurrent_requests,
                None,
            )
        else:
            budgets[b] = QuotaLimits()
    return TenantContext(
        id=tenant.id,
        name=tenant.name,
        slo_class=tenant.slo_class,
        allowed_models=tuple(tenant.allowed_models or ()),
        allowed_regions=tuple(tenant.allowed_regions or ()),
        quotas=TenantQuotas(**budgets),
        disabled=bool(tenant.disabled),
    )


class TenantDirectory:
    """Cached API-key authentication and tenant lookup; thread-safe."""

    def __init__(
        self,
        engine: Engine,
        redis_client: Any,
        *,
        prefix: str = "tf",
        local_ttl_s: float = 0.5,
        redis_ttl_s: float = 60.0,
    ) -> None:
        if local_ttl_s > 1.0:
            raise ValueError("local_ttl_s above 1 s would break the revocation guarantee")
        self.engine = engine
        self.redis = redis_client
        self.prefix = prefix
        self.local_ttl_s = local_ttl_s
        self.redis_ttl_ms = int(redis_ttl_s * 1000)
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[float, _Key | None]] = {}
        self._tenants: dict[str, tuple[float, TenantContext | None]] = {}
        #: keys authenticated since the last write of ``api_keys.last_used_at``
        self._used: dict[str, float] = {}
        self._used_flushed_s = time.monotonic()
        self._flushing = False

    # ---- cache keys --------------------------------------------------------
    def _key_entry(self, digest: str) -> str:
        # "apikey2": JSON with the key's id and limits (plain "apikey" held only the
        # tenant id; the new name keeps processes of either version off the other's)
        return f"{self.prefix}:apikey2:{digest}"

    def _tenant_entry(self, tenant_id: str) -> str:
        return f"{self.prefix}:tenant:{tenant_id}"

    # ---- reads -----------------------------------------------------------------
    def authenticate(self, plaintext: str) -> TenantContext | None:
        """The active tenant owning this key, else None (unknown, revoked, disabled)."""
        if not plaintext:
            return None
        digest = hash_api_key(plaintext)
        key = self._key(digest)
        if key is None:
            return None
        ctx = self.tenant(key.tenant_id)
        if ctx is None or ctx.disabled:
            return None
        self._note_use(digest)
        limits = QuotaLimits(
            requests_per_minute=key.requests_per_minute, tokens_per_minute=key.tokens_per_minute
        )
        return replace(ctx, key_id=key.key_id, key_limits=None if limits.unlimited else limits)

    # ---- last use of a key (admin UI), written off the request path ---------------
    def _note_use(self, digest: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._used[digest] = time.time()
            due = not self._flushing and now - self._used_flushed_s >= LAST_USED_EVERY_S
            if due:
                self._flushing = True
                self._used_flushed_s = now
        if due:
            threading.Thread(target=self.flush_last_used, name="key-last-used", daemon=True).start()

    def flush_last_used(self) -> int:
        """Write the keys' last use to ``api_keys.last_used_at`` (one UPDATE per key,
        at most once a minute per process); returns how many keys were written."""
        with self._lock:
            used, self._used = self._used, {}
        try:
            if not used:
                return 0
            with self.engine.begin() as conn:
                for digest, ts in used.items():
                    conn.execute(
                        sa.update(ApiKey)
                        .where(ApiKey.key_sha256 == digest)
                        .values(last_used_at=datetime.fromtimestamp(ts, UTC))
                    )
            return len(used)
        except Exception:
            log.debug("last use of API keys not written", exc_info=True)
            return 0
        finally:
            with self._lock:
                self._flushing = False

    def _key(self, digest: str) -> _Key | None:
        """The active key with this digest (not revoked, not expired), else None."""
        now = time.monotonic()
        with self._lock:
            hit = self._keys.get(digest)
        if hit is not None and hit[0] > now:
            return hit[1]
        raw = self.redis.get(self._key_entry(digest))
        key: _Key | None
        if raw is not None:
            key = None if raw == _MISSING.encode() else _Key.from_json(raw)
        else:
            with self.engine.connect() as conn:
                row = conn.execute(
                    sa.select(
                        ApiKey.tenant_id,
                        ApiKey.id,
                        ApiKey.requests_per_minute,
                        ApiKey.tokens_per_minute,
                        ApiKey.expires_at,
                    ).where(
                        ApiKey.key_sha256 == digest,
                        ApiKey.revoked_at.is_(None),
                        sa.or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > sa.func.now()),
                    )
                ).first()
            key = None if row is None else _Key(str(row[0]), int(row[1]), row[2], row[3])
            ttl_ms = self.redis_ttl_ms if key else 5000
            if row is not None and row[4] is not None:  # never cached past its expiry
                left_ms = int((row[4] - datetime.now(UTC)).total_seconds() * 1000)
                ttl_ms = max(1, min(ttl_ms, left_ms))
            # unknown keys are cached briefly too: a guessing client cannot hammer PostgreSQL
            self.redis.set(self._key_entry(digest), key.to_json() if key else _MISSING, px=ttl_ms)
        with self._lock:
            self._keys[digest] = (now + self.local_ttl_s, key)
        return key

    def tenant(self, tenant_id: str) -> TenantContext | None:
        now = time.monotonic()
        with self._lock:
            hit = self._tenants.get(tenant_id)
        if hit is not None and hit[0] > now:
            return hit[1]
        raw = self.redis.get(self._tenant_entry(tenant_id))
        ctx: TenantContext | None
        if raw is not None:
            ctx = None if raw == _MISSING.encode() else TenantContext.from_json(raw)
        else:
            with session_scope(self.engine) as session:
                ctx = load_tenant(session, tenant_id)
            self.redis.set(
                self._tenant_entry(tenant_id),
                ctx.to_json() if ctx else _MISSING,
                px=self.redis_ttl_ms if ctx else 5000,
            )
        with self._lock:
            self._tenants[tenant_id] = (now + self.local_ttl_s, ctx)
        return ctx

    # ---- invalidation (called after the database commit) -------------------------
    def forget_keys(self, digests: list[str]) -> None:
        if digests:
            self.redis.delete(*[self._key_entry(d) for d in digests])
        with self._lock:
            for d in digests:
                self._keys.pop(d, None)

    def forget_tenant(self, tenant_id: str) -> None:
        self.redis.delete(self._tenant_entry(tenant_id))
        with self._lock:
            self._tenants.pop(tenant_id, None)
