"""Files + Batches API, tenant quotas on chat, and the batch runner, for one Flask app.

``init_app(app)`` is called by ``web.create_app`` after its own blueprints.
It reads ``DATABASE_URL``, ``REDIS_URL``, ``DATA_DIR`` from the app config
and, optionally:

* ``BATCH_RUNNER`` (default True): run a batch runner thread in this process.
  Lines go through the live path of this process (``app.extensions
  ["tokenfleet"]``, the Gateway) when there is one, else to
  ``BATCH_ENGINE_URL`` (any OpenAI-compatible server) when set.
* ``BATCH_MAX_INFLIGHT`` (default 64): lines this process runs at once; the
  batch tier gets SLOMax's batch share of them (shares written by beat).
* ``CHAT_QUOTAS`` (default True): quota admission around chat completions.
* ``ADMIN_UI`` (default True): mount the admin web UI (:mod:`web.admin`) at ``/admin``.

Without ``DATABASE_URL`` nothing is registered (files and batches need it).
Call ``app.extensions["tokenfleet.tenancy"].close()`` on shutdown.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response

log = logging.getLogger("tokenfleet.batch")


def init_app(app: Flask, **overrides: Any) -> None:
    from web.batch_api.chat_quota import install_chat_quota
    from web.batch_api.openapi import merge_into
    from web.batch_api.routes import batch_bp
    from web.batch_api.services import TenancyServices

    cfg = {**app.config, **overrides}
    if not cfg.get("DATABASE_URL") or not cfg.get("REDIS_URL"):
        log.info("files/batches API disabled: it needs DATABASE_URL and REDIS_URL")
        return
    gw = app.extensions.get("tokenfleet")
    prefix = cfg.get("REDIS_PREFIX") or getattr(getattr(gw, "live", None), "redis_prefix", "tf")
    svc = TenancyServices.build(database_url=cfg["DATABASE_URL"], redis_url=cfg["REDIS_URL"],
                                data_dir=cfg.get("DATA_DIR") or ".tokenfleet", prefix=prefix)
    svc.seed_auth = app.extensions.get("tokenfleet.auth")
    app.extensions["tokenfleet.tenancy"] = svc
    if gw is not None:
        # FleetMind honours the regions a tenant's record allows (cached <= 0.5 s)
        def _regions(tenant_id: str) -> tuple[str, ...]:
            ctx = svc.directory.tenant(tenant_id)
            return ctx.allowed_regions if ctx is not None else ()

        gw.tenant_regions = _regions
    app.register_blueprint(batch_bp)
    if cfg.get("CHAT_QUOTAS", True) and "openai.chat_completions" in app.view_functions:
        install_chat_quota(app)
    svc.usage.start(float(cfg.get("USAGE_FLUSH_S", 2.0)))

    # /openapi.json: add our paths to the document web.routes serves
    view = app.view_functions.get("ops.openapi")
    if view is not None:
        def openapi_with_batches() -> Response:
            import json

            resp: Response = view()
            doc = merge_into(json.loads(resp.get_data()))
            return Response(json.dumps(doc), mimetype="application/json")

        app.view_functions["ops.openapi"] = openapi_with_batches

    if cfg.get("ADMIN_UI", True):
        from web.admin import init_app as init_admin

        init_admin(app, **overrides)

    if cfg.get("BATCH_RUNNER", True):
        start_runner(app, **overrides)


def start_runner(app: Flask, **overrides: Any) -> Any:
    """Start this process' batch runner (once); returns it, or None without an executor.

    Through the app's live gateway when it has one, else ``BATCH_ENGINE_URL``.
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
    svc.runner = BatchRunner(svc.engine, svc.files, executor, config=runner_cfg, gate=svc.gate,
                             capacity=capacity, name="api-batch-runner")
    svc.runner.start()
    return svc.runner


__all__ = ["init_app", "start_runner"]
