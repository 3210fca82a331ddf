"""Settings of the live request path (routing, scraping, timeouts, control loop).

They sit next to :class:`tokenfleet.service.config.ServiceConfig` (stores,
ports, ledger) and are read from ``TOKENFLEET_*`` environment variables with
the same rules, so a worker, the API and beat started by ``tokenfleet up``
agree on them through their environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from tokenfleet.errors import ConfigError

ENV_PREFIX = "TOKENFLEET_"


@dataclass(frozen=True)
class LiveConfig:
    """Every knob of the live path; env var = ``TOKENFLEET_`` + upper-case name."""

    #: router name in tokenfleet.core.routing.ROUTERS
    router: str = "tokenpilot"
    router_seed: int = 0
    #: datacenter selector in tokenfleet.core.fleet.FLEET, run before the router
    #: ("fleetmind"; "none" keeps every request at its home DC)
    fleet_policy: str = "fleetmind"
    #: topology YAML (the simulator's format): regions, RTTs, load ceilings,
    #: tenants' homes and residency. Empty: each DC is its own region, RTTs zero
    topology: str = ""
    #: the datacenter this API replica runs in (requests enter here); "" = none
    entry_dc: str = ""
    #: key prefix in Redis, so several fleets can share one server
    redis_prefix: str = "tf"
    #: how often a worker scrapes its engine's /metrics and /health
    scrape_interval_s: float = 0.5
    #: a snapshot older than this is treated as a dead instance (worker gone)
    stale_after_s: float = 3.0
    #: a request is sent to an instance's own queue only if the router expects
    #: at least this many cached prompt tokens there; else to the shared pool
    affinity_min_cached_tokens: int = 256
    #: ... and at least this fraction of the prompt
    affinity_min_cached_fraction: float = 0.25
    #: a worker takes work from its DC's shared pool queues only while the prompts
    #: waiting for prefill on its engine (uncached tokens) stay under this, so late
    #: binding means "the first engine whose prefill queue is (nearly) empty"
    pool_prefill_budget_tokens: int = 2048
    #: an affinity-queued request whose instance has been dead this long is re-sent
    affinity_dead_after_s: float = 2.0
    #: worker lease on a running request; renewed every lease_ttl_s / 3
    lease_ttl_s: float = 3.0
    #: no token from the engine for this long: the request is aborted and retried
    engine_stall_timeout_s: float = 10.0
    #: connect timeout to an engine
    engine_connect_timeout_s: float = 2.0
    #: engine failures in a row that mark an instance unhealthy, and for how long
    engine_fail_threshold: int = 2
    engine_unhealthy_s: float = 5.0
    #: attempts per request (first try included) before it fails
    max_attempts: int = 3
    #: how long the API waits for a request to finish before answering 504
    request_timeout_s: float = 600.0
    #: control loop (SLOMax) and long cycle (FleetMind) periods
    control_period_s: float = 1.0
    fleet_period_s: float = 60.0
    #: relay streams live this long after the last write (client reconnects, debugging)
    stream_ttl_s: float = 120.0
    #: seconds the ledger row of a request may wait in Redis idempotency state
    request_state_ttl_s: float = 7200.0
    #: "key=tenant,key2=tenant2": API keys accepted without the database (seed keys)
    seed_api_keys: str = ""
    #: Celery broker visibility timeout (Redis/SQS): above the longest queued+running time
    visibility_timeout_s: float = 7200.0
    #: an API server thread waits this long on the keep-alive connection it just
    #: served for the next request (0: hand it straight back to cheroot's selector)
    api_linger_s: float = 1.0

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> LiveConfig:
        environ = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            var = ENV_PREFIX + f.name.upper()
            if var in environ:
                values[f.name] = _coerce(f, environ[var], var)
        for k, v in overrides.items():
            if v is None:
                continue
            if k not in {f.name for f in dataclasses.fields(cls)}:
                raise ConfigError(f"unknown live setting '{k}'")
            values[k] = v
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("scrape_interval_s", "stale_after_s", "lease_ttl_s",
                     "engine_stall_timeout_s", "control_period_s", "fleet_period_s",
                     "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"'{name}' must be > 0 seconds, got {getattr(self, name)}")
        if self.max_attempts < 1:
            raise ConfigError("'max_attempts' must be >= 1")
        if self.stale_after_s < 2 * self.scrape_interval_s:
            raise ConfigError("'stale_after_s' must be at least two scrape intervals")

    def seed_keys(self) -> dict[str, str]:
        """``seed_api_keys`` as {key: tenant}."""
        out: dict[str, str] = {}
        for part in self.seed_api_keys.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, tenant = part.partition("=")
            if not sep or not key or not tenant:
                raise ConfigError(f"seed_api_keys entry '{part}' must look like KEY=TENANT")
            out[key] = tenant
        return out

    def as_env(self) -> dict[str, str]:
        """Environment that reproduces this config in a child process."""
        return {ENV_PREFIX + f.name.upper(): str(getattr(self, f.name))
                for f in dataclasses.fields(self)}


def _coerce(f: dataclasses.Field[Any], raw: str, var: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"environment {var} must be a {kind}, got {raw!r}") from None


