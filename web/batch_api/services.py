"""The tenancy/batch objects one API process shares across requests.

Built once by :func:`web.batch_api.init_app` from the app config
(``REDIS_URL``, ``DATABASE_URL``, ``DATA_DIR``) and kept in
``app.extensions["tokenfleet.tenancy"]``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from tokenfleet.batch.files import FileStore
from tokenfleet.tenancy.directory import TenantContext, TenantDirectory
from tokenfleet.tenancy.gate import TenancyGate, unauthorized
from tokenfleet.tenancy.quota import QuotaEnforcer
from tokenfleet.tenancy.usage import UsageRecorder

log = logging.getLogger("tokenfleet.tenancy")


@dataclass
class TenancyServices:
    engine: Engine
    redis: Any
    directory: TenantDirectory
    quotas: QuotaEnforcer
    usage: UsageRecorder
    files: FileStore
    gate: TenancyGate
    #: the Authenticator of web.auth (seed keys such as the demo key of `tokenfleet up`)
    seed_auth: Any = None
    runner: Any = None
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def build(cls, *, database_url: str, redis_url: str, data_dir: str | Path,
              prefix: str = "tf", engine: Engine | None = None) -> TenancyServices:
        import redis

        from tokenfleet.service.db import make_engine

        eng = engine or make_engine(database_url, pool_size=10)
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=2,
                                      health_check_interval=30)
        directory = TenantDirectory(eng, client, prefix=prefix)
        quotas = QuotaEnforcer(client, prefix=prefix)
        usage = UsageRecorder(client, eng, prefix=prefix)
        files = FileStore(eng, Path(data_dir) / "files")
        return cls(engine=eng, redis=client, directory=directory, quotas=quotas, usage=usage,
                   files=files, gate=TenancyGate(directory, quotas, usage))

    def authenticate(self, authorization: str | None) -> TenantContext:
        """Hashed keys of the ``api_keys`` table first, then the configured seed keys."""
        token = ""
        if authorization:
            scheme, _, rest = authorization.strip().partition(" ")
            if scheme.lower() == "bearer":
                token = rest.strip()
        if not token:
            raise unauthorized()
        ctx = self.directory.authenticate(token)
        if ctx is not None:
            return ctx
        seed = getattr(self.seed_auth, "seed", None) or {}
        principal = seed.get(token)
        if principal is not None:
            known = self.directory.tenant(principal.tenant)
            if known is not None and known.disabled:
                raise unauthorized()
            return known or TenantContext(id=principal.tenant, name=principal.tenant)
        raise unauthorized()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.runner is not None:
            self.runner.stop()
        self.usage.stop()


class ShareCapacity:
    """Batch-tier slots for the runner: ``max_inflight`` x SLOMax's batch share.

    The share is what beat's control loop wrote to Redis (``LiveState.shares``);
    it is re-read at most once a second.
    """

    def __init__(self, state: Any, max_inflight: int, default_share: float = 0.5) -> None:
        self.state = state
        self.max_inflight = max_inflight
        self.default_share = default_share
        self._share = default_share
        self._at = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        now = time.monotonic()
        with self._lock:
            if now - self._at > 1.0:
                self._at = now
                try:
                    self._share = float(self.state.shares().get("batch", self.default_share))
                except Exception:  # noqa: BLE001 - Redis hiccup: keep the last share
                    pass
            share = self._share
        return max(1, round(self.max_inflight * min(1.0, max(0.0, share))))
