"""The Files, Batches and Usage APIs (``/v1/files``, ``/v1/batches``, ``/v1/usage``).

``init_app(app)`` builds the tenancy services one process shares
(:class:`~web.batch_api.services.TenancyServices`: tenant directory, quotas,
usage, file store) from ``DATABASE_URL``, ``REDIS_URL`` and ``DATA_DIR``
(``REDIS_PREFIX``: key prefix, default ``tf``; ``USAGE_FLUSH_S``: usage flush
period, default 2 s), keeps them in ``app.extensions["tokenfleet.tenancy"]``
and registers the blueprint; it does nothing else. ``web.create_app`` calls
it, then wires what depends on it in plain sight: the quota gate of the chat
view, the tenants' allowed regions, the admin UI and :func:`start_runner`.

Call ``app.extensions["tokenfleet.tenancy"].close()`` on shutdown.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask

log = logging.getLogger("tokenfleet.batch")


def init_app(app: Flask, **overrides: Any) -> Any:
    """Mount the files/batches API; returns the tenancy services (None without a database)."""
    from tokenfleet.live.config import LiveConfig
    from web.auth import Authenticator
    from web.batch_api.routes import batch_bp
    from web.batch_api.services import TenancyServices

    cfg = {**app.config, **overrides}
    if not cfg.get("DATABASE_URL") or not cfg.get("REDIS_URL"):
        log.info("files/batches API disabled: it needs DATABASE_URL and REDIS_URL")
        return None
    live: LiveConfig = cfg.get("LIVE") or LiveConfig()
    svc = TenancyServices.build(
        database_url=cfg["DATABASE_URL"],
        redis_url=cfg["REDIS_URL"],
        data_dir=cfg.get("DATA_DIR") or ".tokenfleet",
        prefix=cfg.get("REDIS_PREFIX") or "tf",
        auth_cache_entries=live.auth_cache_entries,
        auth_stale_s=live.auth_stale_s,
    )
    app.extensions["tokenfleet.tenancy"] = svc
    auth = app.extensions.get("tokenfleet.auth")
    if auth is None:
        app.extensions["tokenfleet.auth"] = Authenticator(
            {}, svc.directory, max_key_chars=live.max_api_key_chars
        )
    elif auth.directory is None:
        auth.directory = svc.directory
    app.register_blueprint(batch_bp)
    svc.usage.start(float(cfg.get("USAGE_FLUSH_S", 2.0)))
    return svc


def start_runner(app: Flask, **overrides: Any) -> Any:
    """Start this process' batch runner (once); returns it, or None without an executor.

    Lines go through the app's live gateway when it has one (tier ``batch``),
    else to ``BATCH_ENGINE_URL`` (any OpenAI-compatible server).
    ``BATCH_MAX_INFLIGHT`` (default 64): lines this process runs at once; the
    batch tier gets SLOMax's batch share of them (shares written by beat).
    """
    from tokenfleet.batch.executors import GatewayExecutor, HttpExecutor
    from tokenfleet.batch.runner import BatchRunner, RunnerConfig
    from web.batch_api.services import ShareCapacity

    cfg = {**app.config, **overrides}
    svc = app.extensions["tokenfleet.tenancy"]
    if svc.runner is not None:
        return svc.runner
    gw = app.extensions.get("tokenfleet")
    executor: Any = None
    max_inflight = int(cfg.get("BATCH_MAX_INFLIGHT", 64))
    capacity = None
    if gw is not None:
        executor = GatewayExecutor(gw)
        capacity = ShareCapacity(gw.state, max_inflight)
    elif cfg.get("BATCH_ENGINE_URL"):
        executor = HttpExecutor(str(cfg["BATCH_ENGINE_URL"]))
    if executor is None:
        log.info("no batch runner in this process: no live gateway and no BATCH_ENGINE_URL")
        return None
    runner_cfg = cfg.get("BATCH_RUNNER_CONFIG") or RunnerConfig(max_inflight=max_inflight)
    svc.runner = BatchRunner(
        svc.engine,
        svc.files,
        executor,
        config=runner_cfg,
        gate=svc.gate,
        capacity=capacity,
        name="api-batch-runner",
    )
    svc.runner.start()
    return svc.runner


__all__ = ["init_app", "start_runner"]
