"""The real service stores for tests (no mocks): temp dirs, Redis, PostgreSQL.

Servers run under a fresh temp data dir and are stopped on exit; PostgreSQL
runs with fsync off because test data need not survive a power cut (these
settings are for tests only; they live here, outside the package).

One PostgreSQL serves the whole session (``tests/conftest.py``): it holds a
database migrated to head once, ``tokenfleet_template``, and every test
database is a copy of it (``CREATE DATABASE ... TEMPLATE``: milliseconds,
where running the migrations takes seconds).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tokenfleet.service.config import ServiceConfig, load_config
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis

#: server settings that trade durability for speed (tests only); a small WAL
#: (each database copied from the template is logged whole) keeps the disk quiet
FAST_POSTGRES_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
    "wal_level": "minimal",
    "max_wal_senders": "0",
    "max_wal_size": "64MB",
    "min_wal_size": "32MB",
}
#: the migrated database every test database is copied from
TEMPLATE_DATABASE = "tokenfleet_template"

_names = itertools.count(1)


@contextlib.contextmanager
def temp_data_dir(prefix: str = "tokenfleet-test-") -> Iterator[Path]:
    """A world-traversable temp dir (the postgres user must reach it when we are root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def embedded_redis(data_dir: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(data_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def embedded_postgres(
    data_dir: Path, *, database: str = "tokenfleet", template: bool = True
) -> Iterator[EmbeddedPostgres]:
    """A started PostgreSQL; with ``template``, its migrated template database too."""
    server = EmbeddedPostgres(data_dir, database=database, settings=FAST_POSTGRES_SETTINGS)
    server.start()
    try:
        if template:
            migrated_template(server)
        yield server
    finally:
        server.stop()


def migrated_template(pg: EmbeddedPostgres) -> str:
    """Create and migrate :data:`TEMPLATE_DATABASE` in ``pg`` (once); returns its URL."""
    from tokenfleet.service.db import current_revision, head_revision, upgrade

    url = pg.url_for(TEMPLATE_DATABASE)
    pg.create_database(TEMPLATE_DATABASE)
    if current_revision(url) != head_revision():
        upgrade(url)
    return url


def isolated_config(data_dir: Path, **overrides: object) -> ServiceConfig:
    """A config isolated from the caller's environment and files."""
    return load_config(None, env={}, overrides={"data_dir": data_dir, **overrides})


def fresh_database(pg: EmbeddedPostgres, name: str | None = None) -> str:
    """Database ``name`` (default: a new unique name) in ``pg``, migrated to head, empty;
    returns its URL. A copy of the template database when ``pg`` has one."""
    name = name or f"t{os.getpid()}_{next(_names)}"
    pg.drop_database(name)
    if pg.has_database(TEMPLATE_DATABASE):
        pg.create_database(name, template=TEMPLATE_DATABASE)
        return pg.url_for(name)
    from tokenfleet.service.db import upgrade

    pg.create_database(name)
    url = pg.url_for(name)
    upgrade(url)
    return url


def epoch(seconds: float) -> datetime:
    """A fixed UTC instant for deterministic ledger rows."""
    return datetime(2025, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)
