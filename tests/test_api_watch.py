"""The worker's one watch over the APIs its direct requests wait on
(workers/api_watch.py), against a real (embedded) Redis."""

from __future__ import annotations

import threading
import time
import uuid

import redis

from tokenfleet.live.direct import api_alive_key
from tokenfleet.live.state import LiveState
from tokenfleet.service.embedded import EmbeddedRedis
from workers.api_watch import API_LOST, SETTLED, SETTLED_CHECK_S, ApiWatch, Waiting

LEASE_S = 3.0


def _state(redis_server: EmbeddedRedis) -> LiveState:
    return LiveState(redis.Redis.from_url(redis_server.url), prefix=f"t{uuid.uuid4().hex[:8]}")


class _Told:
    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.event = threading.Event()

    def __call__(self, kind: str) -> None:
        self.kinds.append(kind)
        self.event.set()


def _waiting(state: LiveState, api: str, told: _Told, sent_m: float) -> Waiting:
    rid = uuid.uuid4().hex
    state.r.hset(state.k("req", rid), "status", "running")
    return Waiting(rid, api_alive_key(state, api), told, sent_m=sent_m, status_at_m=sent_m)


def test_lost_apis_and_settled_requests_wake_only_their_waiters(
    redis_server: EmbeddedRedis,
) -> None:
    state = _state(redis_server)
    reads: list[str] = []

    def alive(key: str) -> bool:
        reads.append(key)
        return bool(state.r.exists(key))

    watch = ApiWatch(state, LEASE_S, alive)
    state.r.set(api_alive_key(state, "live-api"), 1)
    fine, dead, settled, fresh = _Told(), _Told(), _Told(), _Told()
    waits = [
        _waiting(state, "live-api", fine, 0.0),
        _waiting(state, "dead-api", dead, 0.0),
        _waiting(state, "live-api", settled, 0.0),
        _waiting(state, "dead-api", fresh, 9.0),  # handed over just now
    ]
    for w in waits:
        watch.add(w)
    state.r.hset(state.k("req", waits[2].request_id), "status", "done")

    # within a lease of the hand-over nothing is asked
    assert watch.check(2.0) == 0 and reads == []
    # past it, each API's key is read once for all its waiters; statuses are
    # read only every SETTLED_CHECK_S
    assert watch.check(5.0) == 1
    assert sorted(reads) == sorted(
        {api_alive_key(state, "live-api"), api_alive_key(state, "dead-api")}
    )
    assert dead.kinds == [API_LOST] and fine.kinds == settled.kinds == fresh.kinds == []
    # later: the settled request is found; the fresh hand-over is past its lease
    assert watch.check(5.0 + SETTLED_CHECK_S + 0.1) == 3
    assert settled.kinds == [SETTLED] and fresh.kinds == [API_LOST] and fine.kinds == []
    for w in waits:
        watch.discard(w)
    assert len(watch) == 0 and watch.check(100.0) == 0


def test_the_watch_thread_tells_a_waiter_its_api_died(redis_server: EmbeddedRedis) -> None:
    state = _state(redis_server)
    watch = ApiWatch(state, 0.05, lambda key: bool(state.r.exists(key)), period_s=0.02)
    told = _Told()
    state.r.set(api_alive_key(state, "api-1"), 1, px=300)  # lapses in 0.3 s
    w = _waiting(state, "api-1", told, time.monotonic())
    watch.add(w)
    try:
        assert told.event.wait(10), "the watch never noticed the lapsed key"
        assert told.kinds[0] == API_LOST
    finally:
        watch.stop()
