"""Where a live-service process finds Redis, the broker and PostgreSQL.

Configured URLs win (``TOKENFLEET_REDIS_URL``/``_BROKER_URL``/``_DATABASE_URL``);
otherwise the embedded servers recorded in the data dir by ``tokenfleet up``
or ``tokenfleet services up``. Without a database the process still serves
requests, it just keeps no ledger (and says so).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenfleet.errors import ConfigError
from tokenfleet.service.config import ServiceConfig, with_redis_db

log = logging.getLogger("tokenfleet.live")


@dataclass(frozen=True, slots=True)
class LiveEndpoints:
    redis_url: str
    broker_url: str
    database_url: str | None


def resolve_endpoints(cfg: ServiceConfig) -> LiveEndpoints:
    from tokenfleet.service.embedded import discover_endpoints, make_embedded_postgres, \
        make_embedded_redis

    try:
        ep = discover_endpoints(cfg)
        return LiveEndpoints(ep.redis_url, ep.broker_url, ep.database_url)
    except ConfigError:
        pass
    redis_url = cfg.redis_url
    if redis_url is None:
        r = make_embedded_redis(cfg)
        state = r._read_state()
        if state and r._state_pid_is_ours(state):
            redis_url = str(state["url"])
    if redis_url is None:
        raise ConfigError(
            f"no Redis found for data dir {cfg.resolved_data_dir()}: run `tokenfleet up` "
            "(or `tokenfleet services up`) first, or set TOKENFLEET_REDIS_URL")
    database_url = cfg.database_url
    if database_url is None:
        p = make_embedded_postgres(cfg)
        state = p._read_state()
        if state and p._state_pid_is_ours(state):
            database_url = str(state["url"])
    if database_url is None:
        log.warning("no PostgreSQL configured or running: requests are served but not "
                    "recorded in the ledger (set TOKENFLEET_DATABASE_URL)")
    broker = cfg.effective_broker_url(redis_url) or with_redis_db(redis_url, 0)
    return LiveEndpoints(redis_url, broker, database_url)
