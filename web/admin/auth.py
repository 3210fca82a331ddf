"""Admin logins for the web UI, separate from tenant API keys.

* Passwords are stored as werkzeug scrypt hashes in ``admin_users``; an API
  key never logs in and an admin session never calls the tenant API.
* Sessions are Flask's signed cookies (``HttpOnly``, ``SameSite=Lax``), with
  a secret kept in ``<data_dir>/admin_secret`` (mode 0600) so it survives
  API restarts; the session also pins the password hash's fingerprint, so
  changing a password logs out every session of that user.
* Every state-changing request carries a per-session CSRF token (hidden form
  field ``csrf_token`` or header ``X-CSRF-Token``), compared in constant time.
* Failed logins are limited per client address (Redis token bucket, 10/min).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from flask import abort, current_app, redirect, request, session, url_for
from sqlalchemy.engine import Engine
from werkzeug.security import check_password_hash, generate_password_hash

from tokenfleet.errors import ConfigError
from tokenfleet.service.db import session_scope
from tokenfleet.service.ledger import utcnow
from tokenfleet.service.queries import append_audit
from tokenfleet.tenancy.models import AdminUser

F = TypeVar("F", bound=Callable[..., Any])
MIN_PASSWORD_CHARS = 8


def set_admin_password(engine: Engine, username: str, password: str, *, actor: str) -> None:
    """Create the admin user or change its password (audited)."""
    if (
        not username
        or len(username) > 100
        or not username.replace("-", "").replace("_", "").isalnum()
    ):
        raise ConfigError("admin user name must be 1-100 letters, digits, '-' or '_'")
    if len(password) < MIN_PASSWORD_CHARS:
        raise ConfigError(f"admin password must have at least {MIN_PASSWORD_CHARS} characters")
    digest = generate_password_hash(password)
    with session_scope(engine) as s:
        user = s.get(AdminUser, username)
        if user is None:
            s.add(AdminUser(username=username, password_hash=digest))
            append_audit(s, actor, "admin_user.create", {"username": username})
        else:
            user.password_hash = digest
            append_audit(s, actor, "admin_user.set_password", {"username": username})


def admin_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(AdminUser)).scalar_one())


def check_login(engine: Engine, username: str, password: str) -> str | None:
    """The password hash fingerprint on success, else None (same cost either way)."""
    with session_scope(engine) as s:
        user = s.get(AdminUser, username)
        digest = user.password_hash if user is not None else _DUMMY_HASH
        ok = check_password_hash(digest, password) and user is not None
        if ok and user is not None:
            user.last_login_at = utcnow()
            return fingerprint(user.password_hash)
    return None


def fingerprint(password_hash: str) -> str:
    return hashlib.sha256(password_hash.encode()).hexdigest()[:16]


_DUMMY_HASH = generate_password_hash(secrets.token_hex(8))


def load_secret_key(data_dir: str | Path) -> bytes:
    """A per-installation session secret, created once with mode 0600."""
    path = Path(data_dir) / "admin_secret"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return key


# ---- per-request helpers -------------------------------------------------------------
def current_admin() -> str | None:
    user = session.get("admin_user")
    if not user:
        return None
    engine = current_app.extensions["tokenfleet.tenancy"].engine
    with engine.connect() as conn:
        digest = conn.execute(
            sa.select(AdminUser.password_hash).where(AdminUser.username == user)
        ).scalar_one_or_none()
    if digest is None or fingerprint(digest) != session.get("admin_fp"):
        session.clear()
        return None
    return str(user)


def login_required(view: F) -> F:
    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if current_admin() is None:
            return redirect(url_for("admin.login", next=request.full_path.rstrip("?")))
        return view(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def csrf_token() -> str:
    token = session.get("csrf")
    if not token:
        token = secrets.token_urlsafe(32)
        session["csrf"] = token
    return str(token)


def check_csrf() -> None:
    """Abort with 400 unless the request carries this session's CSRF token."""
    sent = request.form.get("csrf_token") or request.headers.get("X-CSRF-Token") or ""
    expected = session.get("csrf") or ""
    if not expected or not hmac.compare_digest(str(sent), str(expected)):
        abort(400, description="missing or wrong CSRF token; reload the page and try again")


def actor() -> str:
    return f"admin:{session.get('admin_user', '?')}"
