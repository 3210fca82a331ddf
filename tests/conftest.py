"""Shared fixtures and the test markers.

* One embedded PostgreSQL for the whole session (``pg``), holding a database
  migrated to head once; every test database is a copy of it
  (:func:`tests.support.stores.fresh_database`).
* One real embedded Redis per test module (``redis_server``).
* ``live_stack``: starts a whole live stack (:mod:`tests.support.stack`) on
  the session's PostgreSQL.

Markers (``pytest -m ...``), set here from what a test uses, so a module
needs no boilerplate: ``unit`` (no server), ``redis`` (embedded Redis and/or
PostgreSQL, no workers), ``stack`` (a full live stack: workers, engines, API).
``slow`` and ``traces`` are set by the modules themselves.

Modules that need stricter set-up (tests/test_service_infra.py checks that
the servers really stop) define their own fixtures of the same names, which
take precedence over these.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.stores import embedded_postgres, embedded_redis, temp_data_dir
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis

STORE_FIXTURES = {"redis_server", "pg", "data_dir", "state", "stores", "db_url", "engine"}
STACK_FIXTURES = {"live_stack"}


@pytest.fixture(scope="session")
def session_postgres() -> Iterator[EmbeddedPostgres]:
    with temp_data_dir("tokenfleet-pg-") as d, embedded_postgres(d) as server:
        yield server


@pytest.fixture(scope="module")
def pg(session_postgres: EmbeddedPostgres) -> EmbeddedPostgres:
    return session_postgres


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    with temp_data_dir() as path:
        yield path


@pytest.fixture(scope="module")
def redis_server(data_dir: Path) -> Iterator[EmbeddedRedis]:
    with embedded_redis(data_dir) as server:
        yield server


@pytest.fixture(scope="session")
def live_stack(
    session_postgres: EmbeddedPostgres,
) -> Callable[..., contextlib.AbstractContextManager[Any]]:
    """``with live_stack(router=..., ...) as stack``: a started two-DC live stack
    whose ledger is a fresh database on the session's PostgreSQL."""
    from tests.support.stack import running_stack

    return functools.partial(running_stack, shared_postgres=session_postgres)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & STACK_FIXTURES or item.get_closest_marker("stack"):
            item.add_marker(pytest.mark.stack)
        elif names & STORE_FIXTURES or item.get_closest_marker("redis"):
            item.add_marker(pytest.mark.redis)
        else:
            item.add_marker(pytest.mark.unit)
