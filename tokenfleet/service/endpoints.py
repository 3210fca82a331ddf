"""Where a process finds Redis, the broker and PostgreSQL, and the stack that starts them.

:func:`discover` is the one place that answers "where are the stores": the
configured URLs win (``TOKENFLEET_REDIS_URL`` / ``_BROKER_URL`` /
``_DATABASE_URL``); otherwise the embedded servers recorded in ``data_dir``
by ``tokenfleet up`` or ``tokenfleet services up``. A process that may run
without one of them (the API and workers without a ledger, ``tokenfleet db``
without Redis) says which it ``require``\\ s.

:class:`ServiceStack` starts what is not configured (``tokenfleet up``,
``services up``); :func:`stop_embedded` and :func:`embedded_status` serve the
``services`` commands.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenfleet.errors import ConfigError
from tokenfleet.service.config import ServiceConfig, with_redis_db
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis
from tokenfleet.service.processes import EmbeddedServer

log = logging.getLogger("tokenfleet.service")


@dataclass(frozen=True)
class Endpoints:
    """Where the service's backing stores are; what workers/API connect to.

    ``None``: not configured and not running (only for a store the caller did
    not require)."""

    redis_url: str | None
    database_url: str | None
    broker_url: str | None

    def as_env(self) -> dict[str, str]:
        """TOKENFLEET_* variables that point child processes at these stores."""
        env = {
            "TOKENFLEET_REDIS_URL": self.redis_url,
            "TOKENFLEET_DATABASE_URL": self.database_url,
            "TOKENFLEET_BROKER_URL": self.broker_url,
        }
        return {k: v for k, v in env.items() if v is not None}


def _endpoints(config: ServiceConfig, redis_url: str | None, database_url: str | None) -> Endpoints:
    broker = config.effective_broker_url(redis_url) or (
        with_redis_db(redis_url, 0) if redis_url else None
    )
    return Endpoints(redis_url=redis_url, database_url=database_url, broker_url=broker)


def make_embedded_redis(config: ServiceConfig, *, detach: bool = False) -> EmbeddedRedis:
    return EmbeddedRedis(config.resolved_data_dir(), port=config.embedded_redis_port, detach=detach)


def make_embedded_postgres(
    config: ServiceConfig,
    *,
    detach: bool = False,
    settings: Mapping[str, str] | None = None,
) -> EmbeddedPostgres:
    return EmbeddedPostgres(
        config.resolved_data_dir(),
        port=config.embedded_postgres_port,
        detach=detach,
        database=config.database_name,
        run_as_user=config.embedded_postgres_user,
        settings=settings,
    )


def _recorded(server: EmbeddedServer) -> str | None:
    """URL of the embedded server recorded in the data dir, if it still runs."""
    state = server._read_state()
    if state and server._state_pid_is_ours(state):
        return str(state["url"])
    return None


def discover(config: ServiceConfig, require: Iterable[str] = ("redis", "database")) -> Endpoints:
    """Endpoints for a process that must not start servers (worker, API, beat, ``db``).

    Configured URLs, else the embedded servers recorded in ``data_dir``. A
    store named in ``require`` (``"redis"``, ``"database"``) that is neither
    raises :class:`ConfigError` with the fix; one not required is ``None``.
    """
    need = set(require)
    redis_url = config.redis_url or _recorded(make_embedded_redis(config))
    database_url = config.database_url or _recorded(make_embedded_postgres(config))
    missing = [
        name
        for key, name, url in (
            ("redis", "Redis", redis_url),
            ("database", "PostgreSQL", database_url),
        )
        if key in need and url is None
    ]
    if missing:
        raise ConfigError(
            f"no {' or '.join(missing)} found for data dir {config.resolved_data_dir()}: "
            "run `tokenfleet up` (or `tokenfleet services up`) first, or set "
            "TOKENFLEET_REDIS_URL / TOKENFLEET_DATABASE_URL to external servers"
        )
    if database_url is None and "database" not in need:
        log.warning(
            "no PostgreSQL configured or running: requests are served but not "
            "recorded in the ledger (set TOKENFLEET_DATABASE_URL)"
        )
    return _endpoints(config, redis_url, database_url)


class ServiceStack:
    """Redis + PostgreSQL for one process: external URLs if configured, else embedded.

    ``with ServiceStack(cfg) as ep:`` yields :class:`Endpoints`; leaving the
    block stops only what this stack started.
    """

    def __init__(
        self,
        config: ServiceConfig,
        *,
        detach: bool = False,
        migrate: bool = False,
        postgres_settings: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.detach = detach
        self.migrate = migrate
        self.redis: EmbeddedRedis | None = None
        self.postgres: EmbeddedPostgres | None = None
        self._postgres_settings = postgres_settings
        self.endpoints: Endpoints | None = None

    def start(self) -> Endpoints:
        cfg = self.config
        cfg.resolved_data_dir().mkdir(parents=True, exist_ok=True)
        try:
            if cfg.redis_url:
                redis_url = cfg.redis_url
            else:
                self.redis = make_embedded_redis(cfg, detach=self.detach).start()
                redis_url = self.redis.url
            if cfg.database_url:
                database_url = cfg.database_url
            else:
                self.postgres = make_embedded_postgres(
                    cfg, detach=self.detach, settings=self._postgres_settings
                ).start()
                database_url = self.postgres.url
        except BaseException:
            self.stop()
            raise
        self.endpoints = _endpoints(cfg, redis_url, database_url)
        if self.migrate:
            from tokenfleet.service.db import upgrade

            upgrade(database_url)
        return self.endpoints

    def revive(self) -> list[str]:
        """Restart the embedded servers this stack started that died (same port
        and data dir, so every client reconnects to the URL it has); names
        restarted. ``tokenfleet up`` calls it every second."""
        revived = []
        for server in (self.redis, self.postgres):
            if server is None or not server.owned or server.is_running():
                continue
            log.warning("embedded %s (pid %s) died; restarting it", server.name, server.pid)
            server.restart()
            revived.append(server.name)
        return revived

    def stop(self) -> None:
        """Stop what we started, database last-but-one: Redis first, then PostgreSQL."""
        if self.redis is not None:
            self.redis.stop()
        if self.postgres is not None:
            self.postgres.stop()

    def __enter__(self) -> Endpoints:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_embedded(config: ServiceConfig) -> list[str]:
    """Stop embedded servers recorded in ``data_dir`` whoever started them; names stopped."""
    stopped = []
    for server in (make_embedded_redis(config), make_embedded_postgres(config)):
        state = server._read_state()
        if state and server._state_pid_is_ours(state):
            server.pid = int(state["pid"])
            server.stop(force=True)
            stopped.append(server.name)
        else:
            with contextlib.suppress(OSError):
                server.state_file.unlink()
    return stopped


def embedded_status(config: ServiceConfig) -> list[dict[str, Any]]:
    """One dict per embedded server: name, running, answering, pid, url."""
    out = []
    for server in (make_embedded_redis(config), make_embedded_postgres(config)):
        state = server._read_state() or {}
        running = bool(state) and server._state_pid_is_ours(state)
        if running:
            server.port = int(state["port"])
        out.append(
            {
                "name": server.name,
                "running": running,
                "answering": running and server.ping(),
                "pid": state.get("pid") if running else None,
                "url": state.get("url") if running else None,
                "detached": running and state.get("owner_pid") is None,
            }
        )
    return out
