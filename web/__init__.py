"""The OpenAI-compatible HTTP API (Flask).

``create_app(config)`` builds one app; ``config`` is a mapping with

* ``REDIS_URL`` (required): live state and token streams;
* ``BROKER_URL``: Celery broker (default: ``REDIS_URL``);
* ``DATABASE_URL``: ledger and API-key table (optional; without it no ledger);
* ``DATA_DIR``: where the ledger writer spills rows while the database is down;
* ``LIVE``: a :class:`tokenfleet.live.config.LiveConfig` (default: from env);
* ``API_KEYS``: {key: tenant} seed keys, added to ``LIVE.seed_api_keys``;
* ``ADMISSION``: admission policy name in ``tokenfleet.core.admission.ADMISSION``
  (default: ``LIVE.admission``, ``"slomax"``; ``"none"`` admits everything);
* ``SLO``: a :class:`tokenfleet.core.tiers.SLOConfig`;
* with ``DATABASE_URL``, the files/batches API (:mod:`web.batch_api`) and:
  ``CHAT_QUOTAS`` (default True: tenant quotas on chat completions),
  ``ADMIN_UI`` (default True: the admin UI at ``/admin``), ``BATCH_RUNNER``
  (default True: a batch runner thread in this process) and the keys those
  modules document.

``web/`` speaks HTTP only: the live driver is :class:`tokenfleet.live.gateway.Gateway`
(``app.extensions["tokenfleet"]``), whose refusals (``GatewayError``) become
OpenAI-shaped responses here. Call :func:`close_app` to stop its background
threads, the batch runner, and flush the ledger writer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
from flask import Flask, Response, g
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException

from tokenfleet.live.config import LiveConfig
from tokenfleet.live.gateway import Gateway, GatewayError
from tokenfleet.live.state import LiveState
from tokenfleet.tenancy.gate import TenancyError
from web.auth import Authenticator
from web.errors import ApiError
from web.metrics import ApiMetrics

log = logging.getLogger("tokenfleet.api")


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    cfg = dict(config or {})
    if not cfg.get("REDIS_URL"):
        raise ValueError("create_app needs REDIS_URL (the live state store)")
    live: LiveConfig = cfg.get("LIVE") or LiveConfig.load()
    app = Flask("tokenfleet")
    app.config.update(cfg)
    app.config["LIVE"] = live  # read by web.batch_api and web.admin
    app.json.sort_keys = False  # type: ignore[attr-defined]

    from workers.app import create_celery

    state = LiveState.from_url(cfg["REDIS_URL"], prefix=live.redis_prefix)
    celery = create_celery(cfg.get("BROKER_URL") or cfg["REDIS_URL"], live)
    ledger = None
    if cfg.get("DATABASE_URL"):
        from tokenfleet.service.db import make_engine
        from tokenfleet.service.writer import LedgerWriter

        data_dir = Path(cfg.get("DATA_DIR") or ".tokenfleet")
        ledger = LedgerWriter(
            make_engine(cfg["DATABASE_URL"]), spill_dir=data_dir / "spill", name="api-ledger"
        )
    _warm_publisher(celery)
    from tokenfleet.live.brokers import DcBrokers

    brokers = DcBrokers(
        celery,
        live.dc_brokers(),
        lambda url: create_celery(url, live),
        down_for_s=live.broker_down_s,
    )
    brokers.start()
    gw = Gateway(
        state=state,
        celery=celery,
        live=live,
        slo=cfg.get("SLO"),
        ledger=ledger,
        admission=cfg.get("ADMISSION") or live.admission,
        redis_url=cfg["REDIS_URL"],
        brokers=brokers,
    )
    metrics = ApiMetrics(gw)
    gw.metrics = metrics
    keys = live.seed_keys()
    keys.update(cfg.get("API_KEYS") or {})
    app.extensions["tokenfleet"] = gw
    app.extensions["tokenfleet.auth"] = Authenticator(keys, max_key_chars=live.max_api_key_chars)
    app.extensions["tokenfleet.metrics"] = metrics
    app.extensions["tokenfleet.celery"] = celery
    from web import limits

    limits.install(app, live)  # body size and JSON depth caps (413 / 400)

    from web.access import init_app as init_access_log
    from web.chat import chat_bp
    from web.routes import inline_health, models_bp, ops_bp

    init_access_log(app)  # one line per /v1 request, when its answer has ended
    app.register_blueprint(chat_bp)
    app.register_blueprint(models_bp)
    app.register_blueprint(ops_bp)
    # /health answered by the server's connection thread (web/server.py)
    app.extensions["tokenfleet.inline_health"] = inline_health(gw)

    # with a database: tenants (keys, quotas, regions), /v1/files, /v1/batches, /v1/usage
    from web.batch_api import init_app as init_batch_api
    from web.batch_api import start_runner

    tenancy = init_batch_api(app, REDIS_PREFIX=cfg.get("REDIS_PREFIX") or live.redis_prefix)
    if tenancy is not None:
        gw.tenant_regions = tenancy.allowed_regions  # FleetMind honours them
        if cfg.get("CHAT_QUOTAS", True):
            app.extensions["tokenfleet.quota"] = tenancy  # web.chat charges each request
        if cfg.get("ADMIN_UI", True):
            from web.admin import init_app as init_admin

            init_admin(app)
        if cfg.get("BATCH_RUNNER", True):
            start_runner(app)

    def who() -> dict[str, Any]:
        """The tenant and tier of the refused request, as far as they were known."""
        return {"tenant": g.get("tf_tenant"), "tier": g.get("tf_tier")}

    @app.errorhandler(ApiError)
    def _api_error(err: ApiError) -> Response:
        metrics.error(err.status, reason=err.code if err.status == 401 else None, **who())
        return err.response()

    @app.errorhandler(GatewayError)
    def _refused(err: GatewayError) -> Response:
        metrics.error(err.status, **who())
        return ApiError.from_gateway(err).response()

    @app.errorhandler(TenancyError)
    def _quota(err: TenancyError) -> Response:
        metrics.error(err.status, reason="quota" if err.status == 429 else None, **who())
        resp = Response(json.dumps(err.body()), status=err.status, mimetype="application/json")
        for k, v in err.headers.items():
            resp.headers[k] = v
        return resp

    @app.errorhandler(redis.RedisError)
    def _redis_down(err: redis.RedisError) -> Response:
        # any code on the request path (ours or a hook) that needs Redis while it
        # is down or restarting: a retryable 503, not an internal error
        gw = app.extensions.get("tokenfleet")
        if gw is not None:
            gw.redis_failed()  # /health pings Redis again rather than trust its copy
        metrics.error(503, **who())
        return ApiError(
            503,
            f"the live state store is unavailable ({err.__class__.__name__}); retry shortly",
            code="service_unavailable",
            retry_after_s=2,
        ).response()

    @app.errorhandler(sa_exc.OperationalError)
    @app.errorhandler(sa_exc.InterfaceError)
    def _db_down(err: Exception) -> Response:
        metrics.error(503, **who())
        return ApiError(
            503,
            "the database is unavailable; retry shortly",
            code="service_unavailable",
            retry_after_s=5,
        ).response()

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException) -> Response:
        status = err.code or 500
        metrics.error(status, **who())
        if status == 413:  # a body cut off while it was read (web.limits)
            from web.limits import body_cap, too_large

            return too_large(body_cap()).response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(status)
        return ApiError(status, err.description or err.name, code=code).response()

    @app.errorhandler(Exception)
    def _unexpected(err: Exception) -> Response:
        log.exception("unhandled error")
        metrics.error(500)
        return ApiError(
            500, "internal error in TokenFleet; it was logged", code="internal_error"
        ).response()

    return app


def _warm_publisher(celery: Any, connections: int = 8) -> None:
    """Import the broker transport and open a few pooled connections now, so the
    first requests do not pay ~0.2 s of one-time set-up (kombu imports the Redis
    client lazily on first publish). Best effort: a broker that is down now is
    retried on the first publish."""
    try:
        producers = [
            celery.producer_pool.acquire(block=True, timeout=2.0) for _ in range(connections)
        ]
        try:
            for p in producers:
                p.connection.ensure_connection(max_retries=1)
                p.connection.default_channel  # noqa: B018 - opens the channel
        finally:
            for p in producers:
                p.release()
    except Exception as exc:  # noqa: BLE001
        log.warning("broker not reachable at start-up (%s); will retry on first use", exc)


def close_app(app: Flask) -> None:
    tenancy = app.extensions.get("tokenfleet.tenancy")
    if tenancy is not None:
        tenancy.close()  # batch runner and usage flusher threads
    gw: Gateway = app.extensions["tokenfleet"]
    gw.close()
    if gw.ledger is not None:
        gw.ledger.close()
    try:
        app.extensions["tokenfleet.celery"].close()
    except Exception:  # noqa: BLE001
        pass


__all__ = ["create_app", "close_app"]
