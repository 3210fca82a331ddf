"""Tenant and key administration shared by the CLI and the admin web UI.

Every mutation commits the change and its audit-log row in one transaction,
then drops the affected cache entries (see :mod:`tokenfleet.tenancy.directory`)
so the request path sees it within a second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.errors import ConfigError
from tokenfleet.service.db import session_scope
from tokenfleet.service.ledger import ApiKey, Tenant, generate_api_key, hash_api_key, utcnow
from tokenfleet.service.queries import append_audit
from tokenfleet.tenancy.directory import TenantContext, load_tenant
from tokenfleet.tenancy.models import TenantQuota
from tokenfleet.tenancy.quota import BUDGETS, LIMIT_NAMES, QuotaLimits

#: SLO classes a tenant may declare (tokenfleet.core.tiers.classify reads "batch")
SLO_CLASSES = ("standard", "premium", "batch")
_TENANT_ID_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_")


class CacheInvalidator(Protocol):
    def forget_keys(self, digests: list[str]) -> None: ...
    def forget_tenant(self, tenant_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class KeyInfo:
    id: int
    tenant_id: str
    prefix: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None = None
    #: when an API process last authenticated it (updated at most once a minute)
    last_used_at: datetime | None = None
    #: this key's own limits, on top of the tenant's quotas (None: none)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


def _check_tenant_id(tenant_id: str) -> None:
    if not tenant_id or len(tenant_id) > 64 or not set(tenant_id) <= _TENANT_ID_CHARS:
        raise ConfigError(
            f"tenant id '{tenant_id}' is invalid; use 1-64 characters of a-z, 0-9, '-' and '_'"
        )


def _check_slo_class(slo_class: str) -> None:
    if slo_class not in SLO_CLASSES:
        raise ConfigError(f"unknown SLO class '{slo_class}'; use one of {', '.join(SLO_CLASSES)}")


def _require(session: Any, tenant_id: str) -> Tenant:
    tenant: Tenant | None = session.get(Tenant, tenant_id)
    if tenant is None:
        raise ConfigError(f"tenant '{tenant_id}' does not exist; see `tokenfleet tenants list`")
    return tenant


def create_tenant(
    engine: Engine,
    tenant_id: str,
    *,
    actor: str,
    name: str | None = None,
    slo_class: str = "standard",
    allowed_models: Sequence[str] = (),
    allowed_regions: Sequence[str] = (),
    cache: CacheInvalidator | None = None,
) -> TenantContext:
    _check_tenant_id(tenant_id)
    _check_slo_class(slo_class)
    with session_scope(engine) as session:
        if session.get(Tenant, tenant_id) is not None:
            raise ConfigError(
                f"tenant '{tenant_id}' already exists; use `tokenfleet tenants set-quota`"
            )
        session.add(
            Tenant(
                id=tenant_id,
                name=name or tenant_id,
                slo_class=slo_class,
                allowed_models=list(allowed_models),
                allowed_regions=list(allowed_regions),
            )
        )
        session.flush()
        append_audit(
            session,
            actor,
            "tenant.create",
            {
                "tenant_id": tenant_id,
                "slo_class": slo_class,
                "allowed_models": list(allowed_models),
                "allowed_regions": list(allowed_regions),
            },
        )
        ctx = load_tenant(session, tenant_id)
    if cache is not None:
        cache.forget_tenant(tenant_id)  # a negative entry may be cached
    assert ctx is not None
    return ctx


def update_tenant(
    engine: Engine,
    tenant_id: str,
    *,
    actor: str,
    name: str | None = None,
    slo_class: str | None = None,
    allowed_models: Sequence[str] | None = None,
    allowed_regions: Sequence[str] | None = None,
    disabled: bool | None = None,
    cache: CacheInvalidator | None = None,
) -> TenantContext:
    changes: dict[str, Any] = {}
    if name is not None:
        changes["name"] = name
    if slo_class is not None:
        _check_slo_class(slo_class)
        changes["slo_class"] = slo_class
    if allowed_models is not None:
        changes["allowed_models"] = list(allowed_models)
    if allowed_regions is not None:
        changes["allowed_regions"] = list(allowed_regions)
    if disabled is not None:
        changes["disabled"] = bool(disabled)
    with session_scope(engine) as session:
        tenant = _require(session, tenant_id)
        for k, v in changes.items():
            setattr(tenant, k, v)
        append_audit(session, actor, "tenant.update", {"tenant_id": tenant_id, **changes})
        session.flush()
        ctx = load_tenant(session, tenant_id)
    if cache is not None:
        cache.forget_tenant(tenant_id)
    assert ctx is not None
    return ctx


def set_quota(
    engine: Engine,
    tenant_id: str,
    budget: str,
    changes: Mapping[str, int | None],
    *,
    actor: str,
    cache: CacheInvalidator | None = None,
) -> QuotaLimits:
    """Change some limits of one budget (others keep their value); None = unlimited."""
    if budget not in BUDGETS:
        raise ConfigError(f"unknown budget '{budget}'; use one of {', '.join(BUDGETS)}")
    bad = set(changes) - set(LIMIT_NAMES)
    if bad:
        raise ConfigError(f"unknown quota '{sorted(bad)[0]}'; use one of {', '.join(LIMIT_NAMES)}")
    with session_scope(engine) as session:
        _require(session, tenant_id)
        current = load_tenant(session, tenant_id)
        assert current is not None
        merged = {**current.quotas.for_budget(budget).as_dict(), **changes}
        try:
            limits = QuotaLimits.from_mapping(merged)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        row = session.get(TenantQuota, (tenant_id, budget))
        if row is None:
            row = TenantQuota(tenant_id=tenant_id, budget=budget)
            session.add(row)
        for k, v in limits.as_dict().items():
            setattr(row, k, v)
        row.updated_at = utcnow()
        if budget == "interactive":  # keep the Tenant row's legacy columns truthful
            tenant = session.get(Tenant, tenant_id)
            assert tenant is not None
            tenant.requests_per_minute = limits.requests_per_minute
            tenant.tokens_per_minute = limits.tokens_per_minute
            tenant.max_concurrent_requests = limits.max_concurrent_requests
        append_audit(
            session,
            actor,
            "tenant.set_quota",
            {
                "tenant_id": tenant_id,
                "budget": budget,
                "changes": dict(changes),
                "limits": limits.as_dict(),
            },
        )
    if cache is not None:
        cache.forget_tenant(tenant_id)
    return limits


def list_tenants(engine: Engine) -> list[tuple[TenantContext, int]]:
    """Every tenant with its number of active keys, by id."""
    with session_scope(engine) as session:
        counts = dict(
            session.execute(
                sa.select(ApiKey.tenant_id, sa.func.count())
                .where(ApiKey.revoked_at.is_(None))
                .group_by(ApiKey.tenant_id)
            ).all()
        )
        out = []
        for tid in session.scalars(sa.select(Tenant.id).order_by(Tenant.id)):
            ctx = load_tenant(session, tid)
            assert ctx is not None
            out.append((ctx, int(counts.get(tid, 0))))
    return out


def get_tenant(engine: Engine, tenant_id: str) -> TenantContext | None:
    with session_scope(engine) as session:
        return load_tenant(session, tenant_id)


def create_key(
    engine: Engine,
    tenant_id: str,
    *,
    actor: str,
    name: str | None = None,
    expires_at: datetime | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    cache: CacheInvalidator | None = None,
) -> tuple[str, KeyInfo]:
    """A new key: the plaintext is returned once and only its SHA-256 is stored.
    ``expires_at``: refused from then on (None: never); ``requests_per_minute`` /
    ``tokens_per_minute``: this key's own limits, on top of the tenant's quotas."""
    if expires_at is not None and expires_at <= utcnow():
        raise ConfigError("a key's expiry must be in the future")
    for label, v in (("requests/min", requests_per_minute), ("tokens/min", tokens_per_minute)):
        if v is not None and v < 1:
            raise ConfigError(f"a key's {label} limit must be at least 1 (or unset)")
    plaintext, digest, prefix = generate_api_key()
    with session_scope(engine) as session:
        _require(session, tenant_id)
        key = ApiKey(
            tenant_id=tenant_id,
            key_sha256=digest,
            prefix=prefix,
            name=name,
            expires_at=expires_at,
            requests_per_minute=requests_per_minute,
            tokens_per_minute=tokens_per_minute,
        )
        session.add(key)
        session.flush()
        append_audit(
            session,
            actor,
            "key.create",
            {
                "tenant_id": tenant_id,
                "key_id": key.id,
                "prefix": prefix,
                "name": name,
                "expires_at": expires_at.isoformat() if expires_at else None,
                "requests_per_minute": requests_per_minute,
                "tokens_per_minute": tokens_per_minute,
            },
        )
        info = KeyInfo(
            key.id,
            tenant_id,
            prefix,
            name,
            key.created_at,
            None,
            expires_at,
            None,
            requests_per_minute,
            tokens_per_minute,
        )
    if cache is not None:
        cache.forget_keys([digest])  # the key may have been probed (negative entry) before
    return plaintext, info


def register_key(
    engine: Engine,
    tenant_id: str,
    plaintext: str,
    *,
    actor: str,
    name: str | None = None,
    cache: CacheInvalidator | None = None,
) -> KeyInfo:
    """Store a key whose plaintext the caller chose (``tokenfleet up``'s saved demo
    key, a deployment's ``TOKENFLEET_API_KEY``); only its SHA-256 is kept."""
    if len(plaintext) < 8:
        raise ConfigError("an API key must be at least 8 characters long")
    digest = hash_api_key(plaintext)
    prefix = plaintext[:10]
    with session_scope(engine) as session:
        _require(session, tenant_id)
        if session.scalar(sa.select(ApiKey.id).where(ApiKey.key_sha256 == digest)) is not None:
            raise ConfigError("this API key is already registered")
        key = ApiKey(tenant_id=tenant_id, key_sha256=digest, prefix=prefix, name=name)
        session.add(key)
        session.flush()
        append_audit(
            session,
            actor,
            "key.create",
            {"tenant_id": tenant_id, "key_id": key.id, "prefix": prefix, "name": name},
        )
        info = KeyInfo(key.id, tenant_id, prefix, name, key.created_at, None)
    if cache is not None:
        cache.forget_keys([digest])
    return info


def list_keys(engine: Engine, tenant_id: str | None = None) -> list[KeyInfo]:
    with session_scope(engine) as session:
        stmt = sa.select(ApiKey).order_by(ApiKey.tenant_id, ApiKey.id)
        if tenant_id is not None:
            stmt = stmt.where(ApiKey.tenant_id == tenant_id)
        return [
            KeyInfo(
                k.id,
                k.tenant_id,
                k.prefix,
                k.name,
                k.created_at,
                k.revoked_at,
                k.expires_at,
                k.last_used_at,
                k.requests_per_minute,
                k.tokens_per_minute,
            )
            for k in session.scalars(stmt)
        ]


def revoke_key(
    engine: Engine,
    key: str,
    *,
    actor: str,
    tenant_id: str | None = None,
    cache: CacheInvalidator | None = None,
) -> int:
    """Revoke by numeric id, display prefix or full key; returns how many were revoked.

    A prefix matching keys of several tenants is refused: revoking someone
    else's key by accident is worse than asking for the id.
    """
    cond: Any
    if key.isdigit():
        cond = ApiKey.id == int(key)
    else:
        cond = sa.or_(ApiKey.key_sha256 == hash_api_key(key), ApiKey.prefix == key)
    with session_scope(engine) as session:
        stmt = sa.select(ApiKey).where(cond, ApiKey.revoked_at.is_(None))
        if tenant_id is not None:
            stmt = stmt.where(ApiKey.tenant_id == tenant_id)
        rows = list(session.scalars(stmt.with_for_update()))
        if len({r.tenant_id for r in rows}) > 1:
            raise ConfigError(f"'{key}' matches keys of several tenants; revoke by key id instead")
        now = utcnow()
        for r in rows:
            r.revoked_at = now
        if rows:
            append_audit(
                session,
                actor,
                "key.revoke",
                {
                    "tenant_id": rows[0].tenant_id,
                    "key_ids": [r.id for r in rows],
                    "prefixes": [r.prefix for r in rows],
                },
            )
        digests = [r.key_sha256 for r in rows]
    if cache is not None:
        cache.forget_keys(digests)
    return len(digests)


def audit_log(engine: Engine, limit: int = 100) -> list[dict[str, Any]]:
    from tokenfleet.service.ledger import AuditLog

    with session_scope(engine) as session:
        rows = session.scalars(sa.select(AuditLog).order_by(AuditLog.id.desc()).limit(limit))
        return [
            {"id": r.id, "ts": r.ts, "actor": r.actor, "action": r.action, "payload": r.payload}
            for r in rows
        ]
