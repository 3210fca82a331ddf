"""Helpers for tests that need the real service stores (no mocks).

Importable from any test module: ``from tokenfleet.service.testing import ...``.
Servers run under a fresh temp data dir and are stopped on exit; PostgreSQL
runs with fsync off because test data need not survive a power cut.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator

from tokenfleet.service.config import ServiceConfig, load_config
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis

#: server settings that trade durability for speed; never use in production
FAST_POSTGRES_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
}


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
def embedded_postgres(data_dir: Path, *, database: str = "tokenfleet") -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(data_dir, database=database, settings=FAST_POSTGRES_SETTINGS)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def isolated_config(data_dir: Path, **overrides: object) -> ServiceConfig:
    """A config isolated from the caller's environment and files."""
    return load_config(None, env={}, overrides={"data_dir": data_dir, **overrides})


def fresh_database(pg: EmbeddedPostgres, name: str) -> str:
    """Drop/create database ``name`` in ``pg``, migrate it to head; returns its URL."""
    from tokenfleet.service.db import upgrade

    pg.drop_database(name)
    pg.create_database(name)
    url = pg.url_for(name)
    upgrade(url)
    return url


def epoch(seconds: float) -> datetime:
    """A fixed UTC instant for deterministic ledger rows."""
    return datetime(2025, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=seconds)
