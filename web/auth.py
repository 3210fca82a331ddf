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


class Authenticator:
    def __init__(self, seed_keys: dict[str, str], directory: Any = None) -> None:
        self.seed = dict(seed_keys)
        self.directory = directory

    def authenticate(self, header: str | None) -> Principal:
        """From an ``Authorization`` header value; raises a 401 :class:`ApiError`."""
        if not header:
            raise ApiError(
                401,
                "You didn't provide an API key. Provide it in the "
                "Authorization header as 'Bearer YOUR_KEY'.",
                code="invalid_api_key",
            )
        scheme, _, key = header.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(
                401,
                "Malformed Authorization header; use 'Bearer YOUR_KEY'.",
                code="invalid_api_key",
            )
        tenant = self.seed.get(key)
        if tenant is not None:
            known = self._seed_tenant(tenant)
            if known is None or not known.disabled:
                return Principal(tenant, None, known or TenantContext(id=tenant, name=tenant))
        elif self.directory is not None:
            ctx = self.directory.authenticate(key)
            if ctx is not None:
                return Principal(ctx.id, ctx.slo_class, ctx)
        shown = key[:6] + "..." if len(key) > 8 else "***"
        raise ApiError(
            401,
            f"Incorrect API key provided: {shown}. Ask your TokenFleet "
            "operator for a key (`tokenfleet up` prints a demo key).",
            code="invalid_api_key",
        )

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
