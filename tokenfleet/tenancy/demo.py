"""The demo tenant and key of ``tokenfleet up``: a real tenant, a key that survives restarts.

The key ``up`` prints is an ordinary ``api_keys`` row of the tenant ``demo``
(created on first use), so ``tokenfleet tenants set-quota demo ...``, the admin
UI and the ledger all see the same tenant, and quotas govern it like any
other. Its plaintext is kept in ``<data-dir>/demo-api-key`` (mode 0600) so a
key a user saved keeps working after a restart; only its SHA-256 is in the
database, as for every key.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.service.db import session_scope
from tokenfleet.service.ledger import ApiKey, Tenant, hash_api_key
from tokenfleet.tenancy.admin import CacheInvalidator, create_tenant, register_key

DEMO_TENANT = "demo"
DEMO_KEY_FILE = "demo-api-key"
ACTOR = "tokenfleet up"


@dataclass(frozen=True, slots=True)
class DemoKey:
    key: str
    tenant: str
    #: what happened, for the banner ("created", "kept", "replaced a revoked key", ...)
    note: str


def _key_row(engine: Engine, plaintext: str) -> tuple[str, bool] | None:
    """(tenant, revoked) of the key with this plaintext, None if unknown."""
    with session_scope(engine) as session:
        row = session.execute(
            sa.select(ApiKey.tenant_id, ApiKey.revoked_at).where(
                ApiKey.key_sha256 == hash_api_key(plaintext)
            )
        ).first()
    return None if row is None else (str(row[0]), row[1] is not None)


def _write_key(path: Path, key: str) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    tmp.replace(path)


def ensure_demo_key(
    engine: Engine,
    data_dir: Path,
    *,
    configured_key: str | None = None,
    cache: CacheInvalidator | None = None,
) -> DemoKey:
    """The key ``up`` prints: ``configured_key`` (``TOKENFLEET_API_KEY``) if given,
    else the one saved in the data dir, else a new one; registered for the
    ``demo`` tenant (created if missing) unless it already belongs to a tenant.

    A saved key that an operator revoked is not revived: a new one replaces it.
    """
    with session_scope(engine) as session:
        has_demo = session.get(Tenant, DEMO_TENANT) is not None
    if not has_demo:
        create_tenant(engine, DEMO_TENANT, actor=ACTOR, name="Demo tenant", cache=cache)
    path = data_dir / DEMO_KEY_FILE
    if configured_key:
        key, note = configured_key, "from TOKENFLEET_API_KEY"
    elif path.exists():
        key, note = path.read_text().strip(), f"kept in {path}"
    else:
        key, note = "", ""
    known = _key_row(engine, key) if key else None
    if known is not None and known[1] and not configured_key:
        key, known, note = "", None, f"the saved key was revoked; new key saved in {path}"
    if known is not None and known[1]:
        from tokenfleet.errors import ConfigError

        raise ConfigError("TOKENFLEET_API_KEY is a revoked key; unset it or use another key")
    if not key:
        key = "tf-demo-" + secrets.token_urlsafe(24)
        note = note or f"new; saved in {path} and kept across restarts"
    if known is None:
        register_key(engine, DEMO_TENANT, key, actor=ACTOR, name="demo key", cache=cache)
        tenant = DEMO_TENANT
    else:
        tenant = known[0]
    if not configured_key:
        _write_key(path, key)
    return DemoKey(key, tenant, note)
