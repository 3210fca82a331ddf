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
from tokenfleet.tenancy.directory import TenantDirectory
from tokenfleet.tenancy.gate import TenancyGate
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
    runner: Any = None
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def build(
        cls,
        *,
        database_url: str,
        redis_url: str,
        data_dir: str | Path,
        prefix: str = "tf",
        engine: Engine | None = None,
        auth_cache_entries: int = 10_000,
        auth_stale_s: float = 900.0,
    ) -> TenancyServices:
        import redis

        from tokenfleet.service.db import make_engine

        eng = engine or make_engine(database_url, pool_size=10)
        # a blocking pool: redis-py's default pool refuses its 101st concurrent user
        # (MaxConnectionsError), and every stream that ends records its usage here
        pool = redis.BlockingConnectionPool.from_url(
            redis_url,
            max_connections=512,
            timeout=5.0,
            socket_connect_timeout=2,
            health_check_interval=30,
        )
        client = redis.Redis(connection_pool=pool)
        directory = TenantDirectory(
            eng, client, prefix=prefix, max_entries=auth_cache_entries, stale_s=auth_stale_s
        )
        quotas = QuotaEnforcer(client, prefix=prefix)
        usage = UsageRecorder(client, eng, prefix=prefix)
        files = FileStore(eng, Path(data_dir) / "files")
        return cls(
            engine=eng,
            redis=client,
            directory=directory,
            quotas=quotas,
            usage=usage,
            files=files,
            gate=TenancyGate(directory, quotas, usage),
        )

    def allowed_regions(self, tenant_id: str) -> tuple[str, ...]:
        """Regions a tenant's record allows (``()``: any), for FleetMind (cached <= 0.5 s)."""
        ctx = self.directory.tenant(tenant_id)
        return ctx.allowed_regions if ctx is not None else ()

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
