"""The admin web UI (``/admin``): tenants, keys, quotas, fleet health, batches, audit log.

``init_app(app)`` is called by :func:`web.batch_api.init_app` (it needs the
tenancy services built there). Config keys:

* ``SECRET_KEY``: session signing key (default: ``<DATA_DIR>/admin_secret``,
  created on first use);
* ``ADMIN_USER`` / ``ADMIN_PASSWORD`` (or ``TOKENFLEET_ADMIN_USER`` /
  ``TOKENFLEET_ADMIN_PASSWORD``): create that admin at start if it does not
  exist yet; otherwise use ``tokenfleet admin-user NAME``;
* ``LIVE`` (a :class:`~tokenfleet.live.config.LiveConfig`):
  ``admin_session_lifetime_s`` (default 12 h) and ``admin_cookie_secure``
  (``auto``: ``Secure`` when the request came over https).

The session cookie's attributes are set here, not with ``config.setdefault``:
Flask defines those keys already (31 days, no SameSite), so a default would
never apply.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

from flask import Flask, Request, has_request_context, request
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface

from tokenfleet.live.config import LiveConfig

log = logging.getLogger("tokenfleet.admin")


class CookieFirstSessionInterface(SecureCookieSessionInterface):
    """Flask's signed-cookie sessions, that look for the cookie before building a signer.

    Flask opens the session of every request, and its interface builds the
    signer (key derivation included) before it looks for a cookie. Only the
    admin UI sets one; API clients never send it, and signing cost about
    60 µs of each API request (measured: request context push and pop,
    47 µs without a secret key, 105 µs with one)."""

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        if app.secret_key and self.get_cookie_name(app) not in request.cookies:
            return self.session_class()
        return super().open_session(app, request)

    def get_cookie_secure(self, app: Flask) -> bool:
        """``admin_cookie_secure``: "true", "false", or "auto": Secure when this request
        came over https, directly or through a proxy that says so (X-Forwarded-Proto).
        A wrong "auto" can only make the browser withhold the cookie, never leak it."""
        mode = app.config.get("ADMIN_COOKIE_SECURE", "auto")
        if mode != "auto":
            return bool(mode == "true")
        if not has_request_context():
            return False
        proto = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
        return bool(request.is_secure or proto == "https")


def init_app(app: Flask, **overrides: Any) -> None:
    from web.admin.auth import AdminSessions, LoginThrottle, load_secret_key, set_admin_password
    from web.admin.data import QueueSampler
    from web.admin.views import admin_bp

    svc = app.extensions.get("tokenfleet.tenancy")
    if svc is None:
        log.info("admin UI disabled: it needs the tenancy services (DATABASE_URL, REDIS_URL)")
        return
    cfg = {**app.config, **overrides}
    if not app.secret_key:
        app.secret_key = cfg.get("SECRET_KEY") or load_secret_key(
            cfg.get("DATA_DIR") or ".tokenfleet"
        )
    app.session_interface = CookieFirstSessionInterface()
    live: LiveConfig = cfg.get("LIVE") or LiveConfig()
    app.config["SESSION_COOKIE_SAMESITE"] = "Lax"
    app.config["SESSION_COOKIE_HTTPONLY"] = True
    app.config["ADMIN_COOKIE_SECURE"] = live.admin_cookie_secure
    app.config["PERMANENT_SESSION_LIFETIME"] = timedelta(seconds=live.admin_session_lifetime_s)
    prefix = svc.directory.prefix
    app.extensions["tokenfleet.admin.sessions"] = AdminSessions(
        svc.redis, prefix, live.admin_session_lifetime_s
    )
    app.extensions["tokenfleet.admin.throttle"] = LoginThrottle(svc.redis, prefix)
    app.register_blueprint(admin_bp)

    user = cfg.get("ADMIN_USER") or os.environ.get("TOKENFLEET_ADMIN_USER") or "admin"
    password = cfg.get("ADMIN_PASSWORD") or os.environ.get("TOKENFLEET_ADMIN_PASSWORD")
    if password:
        from tokenfleet.service.db import session_scope
        from tokenfleet.tenancy.models import AdminUser

        with session_scope(svc.engine) as s:
            exists = s.get(AdminUser, user) is not None
        if not exists:
            set_admin_password(svc.engine, user, password, actor="bootstrap")
            log.info("created admin user %s from configuration", user)

    gw = app.extensions.get("tokenfleet")
    if gw is not None:
        sampler = QueueSampler(gw)
        sampler.start()
        app.extensions["tokenfleet.admin.sampler"] = sampler


__all__ = ["init_app"]
