"""Admin logins for the web UI, separate from tenant API keys.

* Passwords are stored as werkzeug scrypt hashes in ``admin_users``; an API
  key never logs in and an admin session never calls the tenant API.
* Sessions are Flask's signed cookies (``HttpOnly``, ``SameSite=Lax``,
  ``Secure`` over https; 12 h by default), with a secret kept in
  ``<data_dir>/admin_secret`` (mode 0600) so it survives API restarts. Each
  login also gets a random session id stored in Redis for the session's
  lifetime (:class:`AdminSessions`): logout deletes it, so a copy of the
  cookie replayed after logout is refused. The session pins the password
  hash's fingerprint too, so changing a password logs out every session.
* Every state-changing request carries a per-session CSRF token (hidden form
  field ``csrf_token`` or header ``X-CSRF-Token``), compared in constant time.
* Failed logins are audited and slowed down by exponential back-off
  (:class:`LoginThrottle`) per (account, address), per address and, for
  distributed guessing, per account; one noisy address therefore slows only
  itself down, never a login from another address.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    sessions: AdminSessions = current_app.extensions["tokenfleet.admin.sessions"]
    if not sessions.valid(str(session.get("sid") or ""), str(user)):
        session.clear()  # logged out (or expired) on the server: a replayed cookie
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


# ---- server-side sessions ---------------------------------------------------------------
class AdminSessions:
    """Live admin session ids in Redis, so logout really ends a session.

    A signed cookie alone stays valid until it expires: logout could only ask
    the browser to forget it. The cookie carries a random id; the id lives in
    Redis (``<prefix>:admin:session:<id>``) for the session's lifetime and is
    deleted on logout, after which the same cookie is refused."""

    def __init__(self, client: Any, prefix: str, lifetime_s: float) -> None:
        self.redis = client
        self.prefix = prefix
        self.lifetime_ms = max(1000, int(lifetime_s * 1000))

    def _key(self, sid: str) -> str:
        return f"{self.prefix}:admin:session:{sid}"

    def create(self, username: str) -> str:
        sid = secrets.token_urlsafe(32)
        self.redis.set(self._key(sid), username, px=self.lifetime_ms)
        return sid

    def valid(self, sid: str, username: str) -> bool:
        raw = self.redis.get(self._key(sid))
        return raw is not None and hmac.compare_digest(raw, username.encode())

    def end(self, sid: str) -> None:
        self.redis.delete(self._key(sid))


# ---- failed-login back-off ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Backoff:
    """After ``free`` failures, each further failure blocks ``base_s * 2**(n - free)``
    seconds (n = failures so far), at most ``max_s``; forgotten ``forget_s`` after
    the last failure."""

    free: int
    base_s: float = 1.0
    max_s: float = 900.0
    forget_s: float = 86400.0

    def wait_s(self, failures: int) -> float:
        if failures < self.free:
            return 0.0
        return float(min(self.max_s, self.base_s * 2.0 ** min(failures - self.free, 40)))


class LoginThrottle:
    """Exponential back-off of admin logins, counted in Redis (shared by API processes).

    Three counters: per (account, address): the usual guesser, blocked after a
    few tries; per address, any account: a guesser cycling user names; per
    account, any address: distributed guessing, with a high threshold and a
    short cap, so it cannot be used to lock the admin out. None is a hard
    limit: each only makes the next try wait, and a success clears the
    (account, address) and account counters.
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        *,
        pair: Backoff = Backoff(free=5),
        address: Backoff = Backoff(free=20),
        account: Backoff = Backoff(free=100, max_s=60.0),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = client
        self.prefix = prefix
        self.rules = {"pair": pair, "addr": address, "acct": account}
        self.clock = clock

    def _keys(self, username: str, addr: str) -> dict[str, str]:
        user = hashlib.sha256(username.encode()).hexdigest()[:32]
        base = f"{self.prefix}:admin:login"
        return {
            "pair": f"{base}:pair:{user}:{addr}",
            "addr": f"{base}:addr:{addr}",
            "acct": f"{base}:acct:{user}",
        }

    def wait_s(self, username: str, addr: str) -> float:
        """Seconds until this (account, address) may try again; 0: now."""
        keys = self._keys(username, addr)
        pipe = self.redis.pipeline(transaction=False)
        for key in keys.values():
            pipe.hget(key, "until")
        now = self.clock()
        untils = [float(v) for v in pipe.execute() if v is not None]
        return max([0.0] + [u - now for u in untils])

    def failed(self, username: str, addr: str) -> float:
        """Count a failure; returns the back-off it starts (0: none yet)."""
        keys = self._keys(username, addr)
        pipe = self.redis.pipeline(transaction=False)
        for key in keys.values():
            pipe.hincrby(key, "failures", 1)
        counts = dict(zip(keys, pipe.execute(), strict=True))
        now = self.clock()
        longest = 0.0
        pipe = self.redis.pipeline(transaction=False)
        for name, key in keys.items():
            rule = self.rules[name]
            wait = rule.wait_s(int(counts[name]))
            if wait > 0:
                pipe.hset(key, "until", repr(now + wait))
            pipe.expire(key, max(1, math.ceil(rule.forget_s)))
            longest = max(longest, wait)
        pipe.execute()
        return longest

    def succeeded(self, username: str, addr: str) -> None:
        keys = self._keys(username, addr)
        self.redis.delete(keys["pair"], keys["acct"])
