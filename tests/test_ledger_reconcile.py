"""The ledger reconciler against a real Redis and PostgreSQL (no workers):
open rows whose request nobody serves any more get exactly one final row;
rows of requests still served are left alone. Time is passed in (``now_s``),
never slept."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.stores import fresh_database
from tokenfleet.live.reconcile import reconcile
from tokenfleet.live.relay import RelayWriter
from tokenfleet.live.state import LiveState
from tokenfleet.service.db import make_engine
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis
from tokenfleet.service.writer import RequestRecord, normalize_row, upsert_statement

GRACE_S = 15.0
TIMEOUT_S = 600.0


@pytest.fixture
def engine(pg: EmbeddedPostgres) -> Iterator[sa.Engine]:
    eng = make_engine(fresh_database(pg))
    try:
        yield eng
    finally:
        eng.dispose()


@pytest.fixture
def state(redis_server: EmbeddedRedis) -> LiveState:
    return LiveState.from_url(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")


def _open(engine: sa.Engine, rid: str, arrival_s: float, status: str = "in_flight") -> None:
    row = RequestRecord(
        request_id=rid,
        tenant_id="t",
        tier="interactive",
        model="m",
        status=status,
        arrival_ts=arrival_s,
        dc="dc-a",
        prompt_tokens=100,
    )
    with engine.begin() as conn:
        conn.execute(upsert_statement(conn.dialect.name), [normalize_row(row)])


def _rows(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        return {
            r["request_id"]: dict(r)
            for r in conn.execute(sa.text("SELECT * FROM requests")).mappings()
        }


def _running(state: LiveState, rid: str, lease: bool) -> None:
    state.create_request(rid, "dc-a.interactive", 3600)
    assert state.claim(rid, 1, "w1", 60.0 if lease else 0.001, "a0") == "run"
    if not lease:
        deadline = time.monotonic() + 10
        while state.lease_alive(rid) and time.monotonic() < deadline:
            time.sleep(0.01)


def _tokens(state: LiveState, rid: str, n_entries: int) -> None:
    relay = RelayWriter(state, rid, 120, "a0")
    for _ in range(n_entries):
        relay.delta("tok ", 2)


def test_reconciler_settles_orphans_once_and_leaves_live_requests_alone(
    engine: sa.Engine, state: LiveState
) -> None:
    now = time.time()
    old = now - 30.0
    # settled in Redis, its rows lost (worker killed before its writer flushed)
    _running(state, "done", lease=True)
    _tokens(state, "done", 3)
    end = RelayWriter(state, "done", 120, "a0").end_fields(
        "stop", {"prompt_tokens": 100, "completion_tokens": 7}
    )
    end.update({"s": "slo_missed", "tf": old + 1, "te": old + 2, "ca": 32})
    assert state.finish("done", "slo_missed", "w1", end_event=end)[0]
    # unknown to Redis (restarted without it)
    state.r.delete(state.k("req", "lost"))
    # worker died after two token entries, nobody re-sent or settled it
    _running(state, "orphan", lease=False)
    _tokens(state, "orphan", 2)
    # still served: a live lease; queued within the timeout; too young to judge
    _running(state, "leased", lease=True)
    state.create_request("queued", "dc-a.interactive", 3600)
    _running(state, "young", lease=False)
    for rid in ("done", "lost", "orphan", "leased", "queued"):
        _open(engine, rid, old)
    _open(engine, "young", now - 1.0)
    # a request whose only row is a redelivery's: settled like an open row
    state.create_request("dup-only", "dc-a.interactive", 3600)
    assert state.finish("dup-only", "cancelled")[0]
    _open(engine, "dup-only", old, status="duplicate")

    first = reconcile(engine, state, request_timeout_s=TIMEOUT_S, grace_s=GRACE_S, now_s=now)
    rows = _rows(engine)
    assert rows["done"]["status"] == "slo_missed"
    assert rows["done"]["completion_tokens"] == 7 and rows["done"]["cached_tokens"] == 32
    assert rows["done"]["instance"] == "a0" and rows["done"]["first_token_ts"] is not None
    assert rows["lost"]["status"] == "failed" and "Redis" in rows["lost"]["error"]
    assert rows["dup-only"]["status"] == "cancelled"
    # the orphan's lease lapse is only noted on the first pass
    assert rows["orphan"]["status"] == "in_flight" and first.watching == 1
    for rid in ("leased", "queued", "young"):
        assert rows[rid]["status"] == "in_flight", rid
    # a late delivery of the lost request is refused now
    assert state.request_state("lost")["status"] == "done"

    second = reconcile(
        engine, state, request_timeout_s=TIMEOUT_S, grace_s=GRACE_S, now_s=now + GRACE_S + 1
    )
    rows = _rows(engine)
    assert rows["orphan"]["status"] == "failed"
    assert rows["orphan"]["completion_tokens"] == 4, "the tokens the client was sent"
    assert rows["orphan"]["prompt_tokens"] == 100
    # a reader still attached to the orphan's stream gets an error event
    last = state.r.xrevrange(state.stream_key("orphan"), count=1)[0][1]
    assert last[b"k"] == b"err"
    assert second.settled == {"failed": 1} and second.alive == 2  # leased, queued
    assert second.watching == 1 and rows["young"]["status"] == "in_flight"  # old enough now
    # past the request timeout nobody waits for the queued one any more
    third = reconcile(
        engine,
        state,
        request_timeout_s=TIMEOUT_S,
        grace_s=GRACE_S,
        now_s=now + TIMEOUT_S + GRACE_S + 1,
    )
    rows = _rows(engine)
    assert rows["queued"]["status"] == "failed" and rows["young"]["status"] == "failed"
    assert rows["leased"]["status"] == "in_flight" and third.settled == {"failed": 2}
    assert len(rows) == 7, "no row was added"
    # nothing left to do: an idempotent pass writes nothing
    assert reconcile(engine, state, request_timeout_s=TIMEOUT_S, grace_s=GRACE_S).written == 0


def test_reconciled_failure_yields_to_a_late_served_row(
    engine: sa.Engine, state: LiveState
) -> None:
    """A worker's row spilled during an outage and replayed after the reconciler
    gave up on the request: the served answer wins, whole."""
    now = time.time()
    _open(engine, "late", now - 30.0)
    reconcile(engine, state, request_timeout_s=TIMEOUT_S, grace_s=GRACE_S, now_s=now)
    assert _rows(engine)["late"]["status"] == "failed"
    served = RequestRecord(
        request_id="late",
        tenant_id="t",
        tier="interactive",
        model="m",
        status="completed",
        arrival_ts=now - 30.0,
        instance="b0",
        completion_tokens=12,
    )
    with engine.begin() as conn:
        conn.execute(upsert_statement(conn.dialect.name), [normalize_row(served)])
    row = _rows(engine)["late"]
    assert (row["status"], row["completion_tokens"], row["instance"]) == ("completed", 12, "b0")
