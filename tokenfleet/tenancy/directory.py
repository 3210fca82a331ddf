"""Who is calling: API key -> tenant, with caches that honour revocation within 1 s.

Lookups go local memory (``local_ttl_s``, 0.5 s by default) -> Redis
(``redis_ttl_s``) -> PostgreSQL. Every mutation (revoke, quota change,
disable) deletes the Redis entries it affects before returning, so after a
revoke the only stale copies are in the local memories of API processes,
which expire within ``local_ttl_s``: a revoked key stops working everywhere
within half a second without any cross-process messaging.

Only SHA-256 digests of keys are used as cache keys; plaintext keys never
reach Redis or the database.

A local entry past half its freshness is read again in the background
the next time it is used (one refresher thread, one read per entry at a
time), while the request is answered from memory: under steady traffic no
request waits for Redis, and nothing is ever served older than
``local_ttl_s`` (the entry keeps the time its read began). A process whose
keys go unused for longer than ``local_ttl_s`` reads on the request path as
before.

The local memory is bounded (``max_entries`` keys and as many tenants,
least recently used out first), unknown keys included, so a client sending
random keys cannot grow an API process. It also keeps each answer as the
*last known good* for ``stale_s``: while PostgreSQL is unreachable a key or
tenant looked up in that window keeps working from memory (a key this
process never saw gets 503). Revocations need the database, so none can be
missed during the outage, except one committed less than ``local_ttl_s``
before the database went away.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

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
#: database errors that mean "unreachable" (not a bad query): served from stale memory
_DB_DOWN: tuple[type[Exception], ...] = (sa.exc.OperationalError, sa.exc.InterfaceError)
V = TypeVar("V")


class _Memo(Generic[V]):
    """A bounded LRU of lookups: fresh for ``fresh_s``, kept as last known good for
    ``stale_s``; not thread-safe (the directory holds its lock around it)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._d: OrderedDict[str, tuple[float, float, V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: str, now: float) -> tuple[bool, bool, V | None]:
        """(found, fresh, value); an entry past its stale deadline is dropped."""
        hit = self._d.get(key)
        if hit is None:
            return False, False, None
        fresh_until, stale_until, value = hit
        if now > stale_until and now > fresh_until:
            del self._d[key]
            return False, False, None
        self._d.move_to_end(key)
        return True, now < fresh_until, value

    def fresh_until(self, key: str) -> float:
        """When ``key``'s entry stops being fresh (-inf: no entry)."""
        hit = self._d.get(key)
        return hit[0] if hit is not None else float("-inf")

    def put(self, key: str, value: V, fresh_until: float, stale_until: float) -> None:
        self._d[key] = (fresh_until, stale_until, value)
        self._d.move_to_end(key)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    def pop(self, key: str) -> None:
        self._d.pop(key, None)


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
        max_entries: int = 10_000,
        stale_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if local_ttl_s > 1.0:
            raise ValueError("local_ttl_s above 1 s would break the revocation guarantee")
        self.engine = engine
        self.redis = redis_client
        self.prefix = prefix
        self.local_ttl_s = local_ttl_s
        self.redis_ttl_ms = int(redis_ttl_s * 1000)
        self.stale_s = stale_s
        self.clock = clock
        #: lookups answered from stale memory because PostgreSQL was unreachable
        self.stale_served = 0
        self._warned_at = -1e18
        self._lock = threading.Lock()
        self._keys: _Memo[_Key | None] = _Memo(max_entries)
        self._tenants: _Memo[TenantContext | None] = _Memo(max_entries)
        #: keys authenticated since the last write of ``api_keys.last_used_at``
        self._used: dict[str, float] = {}
        self._used_flushed_s = time.monotonic()
        self._flushing = False
        #: entries being read again ahead of their expiry ("key"/"tenant", id)
        self._refreshing: dict[tuple[str, str], None] = {}
        self._refresh_kick = threading.Condition(self._lock)
        self._refresher: threading.Thread | None = None

    # ---- cache keys --------------------------------------------------------
    def _key_entry(self, digest: str) -> str:
        # "apikey2": JSON with the key's id and limits (plain "apikey" held only the
        # tenant id; the new name keeps processes of either version off the other's)
        return f"{self.prefix}:apikey2:{digest}"

    def _tenant_entry(self, tenant_id: str) -> str:
        return f"{self.prefix}:tenant:{tenant_id}"

    # ---- reads -----------------------------------------------------------------
    def authenticate(self, plaintext: str) -> TenantContext | None:
        """The active tenant owning this key, else None (unknown, revoked, expired,
        disabled), with the key's id and own limits."""
        ctx = self.lookup(plaintext)
        if ctx is None or ctx.disabled:
            return None
        return ctx

    def lookup(self, plaintext: str) -> TenantContext | None:
        """The tenant owning this key, disabled or not (None: unknown, revoked or
        expired key), with the key's id and own limits."""
        if not plaintext:
            return None
        digest = hash_api_key(plaintext)
        key = self._key(digest)
        if key is None:
            return None
        ctx = self.tenant(key.tenant_id)
        if ctx is None:
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

    # ---- reading entries again ahead of their expiry --------------------------------
    def _maybe_refresh_locked(self, memo: _Memo[Any], kind: str, key: str, now: float) -> None:
        """Queue a background read of an entry past half its freshness (lock held)."""
        if memo.fresh_until(key) - now >= self.local_ttl_s / 2:
            return
        item = (kind, key)
        if item in self._refreshing:
            return
        self._refreshing[item] = None
        if self._refresher is None:
            self._refresher = threading.Thread(
                target=self._refresh_loop, name="tenancy-refresh", daemon=True
            )
            self._refresher.start()
        self._refresh_kick.notify()

    def _refresh_loop(self) -> None:
        while True:
            with self._lock:
                while not self._refreshing:
                    self._refresh_kick.wait()
                kind, key = next(iter(self._refreshing))
            try:
                now = self.clock()  # before the read: the entry's age counts from here
                if kind == "key":
                    self._load_key(key, now, stale_ok=False)
                else:
                    self._load_tenant(key, now, stale_ok=False)
            except Exception:  # the request path reads it itself once it expires
                log.debug("background read of %s %s failed", kind, key, exc_info=True)
            finally:
                with self._lock:
                    self._refreshing.pop((kind, key), None)

    def _remember(self, memo: _Memo[Any], key: str, value: Any, now: float) -> None:
        with self._lock:
            memo.put(key, value, now + self.local_ttl_s, now + max(self.stale_s, 0.0))

    def _stale(self, memo: _Memo[Any], key: str, now: float, exc: Exception) -> Any:
        """The last known good answer while the database is down, else re-raise."""
        with self._lock:
            found, _, value = memo.get(key, now)
        if not found or self.stale_s <= 0:
            raise exc
        self.stale_served += 1
        if now - self._warned_at >= 10.0:  # one line per 10 s, not one per request
            self._warned_at = now
            log.warning(
                "database unreachable (%s); serving cached keys and tenants up to %.0f s old",
                exc.__class__.__name__,
                self.stale_s,
            )
        return value

    def _key(self, digest: str) -> _Key | None:
        """The active key with this digest (not revoked, not expired), else None."""
        now = self.clock()
        with self._lock:
            found, fresh, key = self._keys.get(digest, now)
            if found and fresh:
                self._maybe_refresh_locked(self._keys, "key", digest, now)
                return key
        return self._load_key(digest, now)

    def _load_key(self, digest: str, now: float, stale_ok: bool = True) -> _Key | None:
        """The key from Redis, else PostgreSQL, remembered as read at ``now``
        (``stale_ok``: the last known good while PostgreSQL is unreachable)."""
        raw = self.redis.get(self._key_entry(digest))
        if raw is not None:
            key = None if raw == _MISSING.encode() else _Key.from_json(raw)
        else:
            try:
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
            except _DB_DOWN as exc:
                if not stale_ok:
                    raise
                stale: _Key | None = self._stale(self._keys, digest, now, exc)
                return stale
            key = None if row is None else _Key(str(row[0]), int(row[1]), row[2], row[3])
            ttl_ms = self.redis_ttl_ms if key else 5000
            if row is not None and row[4] is not None:  # never cached past its expiry
                left_ms = int((row[4] - datetime.now(UTC)).total_seconds() * 1000)
                ttl_ms = max(1, min(ttl_ms, left_ms))
            # unknown keys are cached briefly too: a guessing client cannot hammer PostgreSQL
            self.redis.set(self._key_entry(digest), key.to_json() if key else _MISSING, px=ttl_ms)
        self._remember(self._keys, digest, key, now)
        return key

    def tenant(self, tenant_id: str) -> TenantContext | None:
        now = self.clock()
        with self._lock:
            found, fresh, ctx = self._tenants.get(tenant_id, now)
            if found and fresh:
                self._maybe_refresh_locked(self._tenants, "tenant", tenant_id, now)
                return ctx
        return self._load_tenant(tenant_id, now)

    def _load_tenant(
        self, tenant_id: str, now: float, stale_ok: bool = True
    ) -> TenantContext | None:
        """The tenant from Redis, else PostgreSQL, remembered as read at ``now``
        (``stale_ok``: as for :meth:`_load_key`)."""
        raw = self.redis.get(self._tenant_entry(tenant_id))
        if raw is not None:
            ctx = None if raw == _MISSING.encode() else TenantContext.from_json(raw)
        else:
            try:
                with session_scope(self.engine) as session:
                    ctx = load_tenant(session, tenant_id)
            except _DB_DOWN as exc:
                if not stale_ok:
                    raise
                stale: TenantContext | None = self._stale(self._tenants, tenant_id, now, exc)
                return stale
            self.redis.set(
                self._tenant_entry(tenant_id),
                ctx.to_json() if ctx else _MISSING,
                px=self.redis_ttl_ms if ctx else 5000,
            )
        self._remember(self._tenants, tenant_id, ctx, now)
        return ctx

    # ---- invalidation (called after the database commit) -------------------------
    def forget_keys(self, digests: list[str]) -> None:
        if digests:
            self.redis.delete(*[self._key_entry(d) for d in digests])
        with self._lock:
            for d in digests:
                self._keys.pop(d)

    def forget_tenant(self, tenant_id: str) -> None:
        self.redis.delete(self._tenant_entry(tenant_id))
        with self._lock:
            self._tenants.pop(tenant_id)
