"""Bearer API keys -> tenant: the one authenticator of every API route.

Seed keys come from configuration (``TOKENFLEET_SEED_API_KEYS`` and the
bootstrap ``TOKENFLEET_API_KEY``, which maps to the tenant ``demo``); other
keys are the hashed keys of the ``api_keys`` table, read through the tenancy
directory (:class:`tokenfleet.tenancy.directory.TenantDirectory`, cached in
Redis and locally so a revoked key is refused within a second). Without a
database only seed keys exist.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenfleet.tenancy.directory import TenantContext
from web.errors import ApiError

log = logging.getLogger("tokenfleet.api")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant id, its SLO class (None for seed keys) and
    its tenancy record (quotas, allowed models and regions)."""

    tenant: str
    slo_class: str | None = None
    context: TenantContext | None = None


#: the one 401 message of every endpoint: a client cannot tell a missing, malformed,
#: unknown or revoked key apart (and so cannot probe which keys exist)
INVALID_KEY_MESSAGE = (
    "Invalid or missing API key. Send it in the Authorization header as "
    "'Bearer YOUR_KEY'; ask your TokenFleet operator for a key (`tokenfleet up` "
    "prints a demo key)."
)
#: TokenFleet keys are 46 characters; anything far longer is not a key
MAX_KEY_CHARS = 256


def invalid_key() -> ApiError:
    return ApiError(401, INVALID_KEY_MESSAGE, code="invalid_api_key")


def tenant_disabled(tenant: str) -> ApiError:
    return ApiError(
        403,
        f"Tenant '{tenant}' is disabled, so its API keys are refused. Ask your TokenFleet "
        "operator to enable it (admin UI, or `tokenfleet tenants`).",
        code="tenant_disabled",
    )


class Authenticator:
    def __init__(
        self,
        seed_keys: dict[str, str],
        directory: Any = None,
        *,
        max_key_chars: int = MAX_KEY_CHARS,
    ) -> None:
        self.seed = dict(seed_keys)
        self.directory = directory
        self.max_key_chars = max_key_chars

    def authenticate(self, header: str | None) -> Principal:
        """From an ``Authorization`` header value; raises a 401 :class:`ApiError`
        (no, malformed, unknown or revoked key) or a 403 (the tenant is disabled)."""
        if not header:
            raise invalid_key()
        scheme, _, key = header.strip().partition(" ")
        key = key.strip()
        # too long: refused before any hashing, cache or database lookup
        if scheme.lower() != "bearer" or not key or len(key) > self.max_key_chars:
            raise invalid_key()
        tenant = self.seed.get(key)
        if tenant is not None:
            known = self._seed_tenant(tenant)
            if known is not None and known.disabled:
                raise tenant_disabled(tenant)
            return Principal(tenant, None, known or TenantContext(id=tenant, name=tenant))
        if self.directory is not None:
            ctx = self.directory.lookup(key)
            if ctx is not None:
                if ctx.disabled:
                    raise tenant_disabled(ctx.id)
                return Principal(ctx.id, ctx.slo_class, ctx)
        raise invalid_key()

    def _seed_tenant(self, tenant: str) -> TenantContext | None:
        """The tenancy record of a seed key's tenant (its quotas; disabled or not).
        Seed keys are trusted configuration: they keep working, without a record,
        while the database or Redis is down."""
        if self.directory is None:
            return None
        try:
            ctx: TenantContext | None = self.directory.tenant(tenant)
            return ctx
        except Exception:
            log.warning(
                "tenant %s of a seed key: record unavailable; serving it without quotas",
                tenant,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            return None
