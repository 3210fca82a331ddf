"""Operator experience (issue #18): the demo tenant and key of ``tokenfleet up``,
failing fast on a taken port, metrics, access logs, quiet control ticks,
``/v1/completions``, simulator output and the container files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.stores import fresh_database
from tokenfleet.service.db import make_engine
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis

ROOT = Path(__file__).resolve().parents[1]


# ---- the demo tenant and key ------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(pg: EmbeddedPostgres) -> Iterator[sa.Engine]:
    eng = make_engine(fresh_database(pg, "operator"), pool_size=2)
    yield eng
    eng.dispose()


def test_demo_key_belongs_to_a_real_tenant_and_survives_restarts(
    engine: sa.Engine, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    from tokenfleet.tenancy import admin
    from tokenfleet.tenancy.demo import DEMO_KEY_FILE, ensure_demo_key
    from tokenfleet.tenancy.directory import TenantDirectory

    client = redis_server.client()
    directory = TenantDirectory(engine, client, prefix="optest")
    first = ensure_demo_key(engine, tmp_path, cache=directory)
    assert first.tenant == "demo"
    saved = tmp_path / DEMO_KEY_FILE
    assert saved.read_text().strip() == first.key
    assert saved.stat().st_mode & 0o077 == 0, "the key file is private to its owner"
    # a restart (a second `up` on the same data dir) prints the same key, which still works
    again = ensure_demo_key(engine, tmp_path, cache=directory)
    assert again.key == first.key
    ctx = directory.authenticate(first.key)
    assert ctx is not None and ctx.id == "demo"
    # a real tenant: listed, with one key, and quotas apply to it
    listed = {t.id: n for t, n in admin.list_tenants(engine)}
    assert listed.get("demo") == 1
    admin.set_quota(engine, "demo", "interactive", {"requests_per_minute": 7}, actor="test")
    tenant = admin.get_tenant(engine, "demo")
    assert tenant is not None and tenant.quotas.interactive.requests_per_minute == 7
    # an operator revoked it: the next `up` does not revive it, it saves a new one
    assert admin.revoke_key(engine, first.key, actor="test", cache=directory) == 1
    fresh = ensure_demo_key(engine, tmp_path, cache=directory)
    assert fresh.key != first.key and "revoked" in fresh.note
    assert saved.read_text().strip() == fresh.key
    assert directory.authenticate(fresh.key) is not None
    assert directory.authenticate(first.key) is None
    # TOKENFLEET_API_KEY: registered for demo too, and not written to the data dir
    chosen = ensure_demo_key(engine, tmp_path, configured_key="tf-chosen-by-operator")
    assert chosen.key == "tf-chosen-by-operator" and chosen.tenant == "demo"
    assert saved.read_text().strip() == fresh.key
    client.close()


def test_up_fails_at_once_with_the_reason_when_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
        r = subprocess.run(
            [sys.executable, "-m", "tokenfleet.cli.main", "up", "--port", str(port)]
            + ["--data-dir", str(tmp_path / "tf")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr
    assert "--port" in r.stderr and "make up PORT=" in r.stderr
    assert not (tmp_path / "tf" / "run").exists(), "nothing was started"


def test_make_up_takes_a_port_and_shows_install_progress() -> None:
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\nup:", 1)[1].split("\n\n", 1)[0]
    assert "--port $(PORT)" in recipe
    setup = text.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    assert "--quiet" not in setup and "echo" in setup
