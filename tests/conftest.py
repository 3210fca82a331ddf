"""Shared fixtures: one real embedded Redis and PostgreSQL per test module.

Modules that need stricter set-up (tests/test_service_infra.py checks that
the servers really stop) define their own fixtures of the same names, which
take precedence over these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis
from tokenfleet.service.testing import embedded_postgres, embedded_redis, temp_data_dir


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    with temp_data_dir() as path:
        yield path


@pytest.fixture(scope="module")
def redis_server(data_dir: Path) -> Iterator[EmbeddedRedis]:
    with embedded_redis(data_dir) as server:
        yield server


@pytest.fixture(scope="module")
def pg(data_dir: Path) -> Iterator[EmbeddedPostgres]:
    with embedded_postgres(data_dir) as server:
        yield server
