"""Bearer API keys -> tenant.

Seed keys come from configuration (``TOKENFLEET_SEED_API_KEYS`` and the
bootstrap ``TOKENFLEET_API_KEY``, which maps to the tenant ``demo``); other
keys are looked up, hashed, in the ``api_keys`` table and cached briefly so
the database is not on every request's path.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from web.errors import ApiError

# Revocation must take effect within 1 s on every endpoint (docs/tenancy.md), so a
# valid key is trusted from the local cache for half a second at most.
POSITIVE_TTL_S = 0.5
NEGATIVE_TTL_S = 0.5


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    slo_class: str | None = None


class Authenticator:
    def __init__(self, seed_keys: dict[str, str], engine: Any = None) -> None:
        self.seed = {k: Principal(t) for k, t in seed_keys.items()}
        self.engine = engine
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()

    def authenticate(self, header: str | None) -> Principal:
        if not header:
            raise ApiError(401, "You didn't provide an API key. Provide it in the "
                           "Authorization header as 'Bearer YOUR_KEY'.",
                           code="invalid_api_key")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "Malformed Authorization header; use 'Bearer YOUR_KEY'.",
                           code="invalid_api_key")
        p = self.seed.get(key)
        if p is None:
            p = self._lookup(key)
        if p is None:
            shown = key[:6] + "..." if len(key) > 8 else "***"
            raise ApiError(401, f"Incorrect API key provided: {shown}. Ask your TokenFleet "
                           "operator for a key (`tokenfleet up` prints a demo key).",
                           code="invalid_api_key")
        return p

    def _lookup(self, key: str) -> Principal | None:
        if self.engine is None:
            return None
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        try:
            from tokenfleet.service.db import session_scope
            from tokenfleet.service.queries import lookup_api_key

            with session_scope(self.engine) as session:
                tenant = lookup_api_key(session, key)
                p = (Principal(tenant.id, tenant.slo_class)
                     if tenant is not None and not tenant.disabled else None)
        except Exception:  # noqa: BLE001 - database down: fail closed, retryable
            raise ApiError(503, "cannot verify the API key right now (database "
                           "unavailable); retry shortly", code="service_unavailable",
                           retry_after_s=2) from None
        with self._lock:
            self._cache[key] = (now + (POSITIVE_TTL_S if p else NEGATIVE_TTL_S), p)
        return p
