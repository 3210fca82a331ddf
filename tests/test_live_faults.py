"""Faults on the live path, injected for real: kill -9 a worker process, engines
that answer 5xx or stall, a Redis restart, a PostgreSQL outage.

One stack (two DCs, one instance each) with the emulators at real time so
prefills take long enough to kill a worker in the middle of one. Tests run in
file order and each leaves the stack healthy for the next.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from tests.support.stack import API_KEY, InstanceSpec, LiveStack

# ~40k tokens: about 2.7 s of prefill on the emulated H200
_LONG = " ".join(f"Paragraph {i} of the contract, with clauses." for i in range(3700))


def long_prompt(copies: int = 1) -> str:
    """A fresh one each time: a cached prefix would make the prefill instant."""
    return f"[{uuid.uuid4().hex}] " + " ".join([_LONG] * copies)


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[LiveStack]:
    # Tenant quotas are off: this file checks that the live path itself keeps
    # serving through faults (keys from the database are served from the API's
    # last-known-good cache during a PostgreSQL outage, tested below).
    # DC selection off: the router alternates over both instances, so each fault
    # below meets traffic (FleetMind would learn to avoid a failing DC instead).
    # Its own PostgreSQL (not the session's): a test below stops and restarts it.
    with live_stack(
        router="round_robin",
        time_scale=1.0,
        shared_postgres=None,
        # Express dispatch off: the worker faults below need a worker in the
        # request's path (the API's own attempts: tests/test_live_express.py).
        live_overrides={
            "engine_fail_threshold": 2,
            "fleet_policy": "off",
            "express_dispatch": False,
        },
        app_config={"CHAT_QUOTAS": False},
        instances=[InstanceSpec("dc-a", "a0"), InstanceSpec("dc-b", "b0")],
    ) as s:
        yield s


@pytest.fixture
def healthy(stack: LiveStack) -> Iterator[LiveStack]:
    """Every worker alive and every engine healthy before and after a test."""
    _heal(stack)
    yield stack
    _heal(stack)


def _heal(stack: LiveStack) -> None:
    for emu in stack.emulators.values():
        emu.config.fail_5xx_rate = 0.0
        emu.loop.stall_after_s = None
    assert stack.sup is not None
    for spec in stack.instances:
        child = stack.sup.children.get(f"worker-{spec.instance_id}")
        if child is None or not child.alive():
            stack.start_worker(spec)
    stack.wait_ready(timeout_s=30)


def _running(
    stack: LiveStack, since: float, first_token: bool, timeout_s: float = 10.0
) -> tuple[str, str]:
    """(request id, instance) of a request that is running (with/without tokens)."""
    r = stack.gateway.state.r
    prefix = stack.gateway.state.k("req", "")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for key in r.scan_iter(match=prefix + "*", count=500):
            st = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
            if (
                st.get("status") == "running"
                and float(st.get("queued_at", 0)) >= since
                and (st.get("first_token") == "1") == first_token
            ):
                return key.decode()[len(prefix) :], st["instance"]
        time.sleep(0.05)
    raise AssertionError("no running request found")


def _other(stack: LiveStack, instance: str) -> str:
    return next(s.instance_id for s in stack.instances if s.instance_id != instance)


def test_worker_killed_before_first_token_is_retried_elsewhere(healthy: LiveStack) -> None:
    stack = healthy
    c = stack.client(timeout=60)
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["resp"] = c.chat.completions.create(
                model=stack.model,
                max_tokens=4,
                # ~83k tokens, ~6 s of prefill: the API must see the lost lease
                # (within lease_ttl_s + half of it, 2.25 s here) before the first
                # token; with ~2.7 s of prefill a slow check lost that race
                messages=[{"role": "user", "content": long_prompt(copies=2)}],
            )
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc

    t0 = time.time()
    th = threading.Thread(target=call)
    th.start()
    rid, victim = _running(stack, t0, first_token=False)
    stack.sup.kill(f"worker-{victim}")  # type: ignore[union-attr]  # SIGKILL mid-prefill
    th.join(60)
    assert not th.is_alive(), "the request hung"
    assert "error" not in out, out.get("error")
    assert out["resp"].usage.completion_tokens >= 1
    rows = stack.ledger_rows(
        f"request_id = '{rid}'",
        expect=lambda rows: bool(rows) and rows[0]["status"] in ("completed", "slo_missed"),
    )
    row = rows[0]
    assert row["status"] in ("completed", "slo_missed")
    assert row["instance"] == _other(stack, victim)
    assert row["attempts"] == 2
    assert stack.gateway.state.counters().get("api_redispatches", 0) >= 1


def test_worker_killed_after_first_token_ends_with_an_error_event(healthy: LiveStack) -> None:
    stack = healthy
    c = stack.client(timeout=60)
    t0 = time.time()
    stream = c.chat.completions.create(
        model=stack.model,
        max_tokens=4000,
        stream=True,
        extra_body={"vllm_xargs": {"output_tokens": 4000}},
        messages=[{"role": "user", "content": "tell me a long story"}],
    )
    it = iter(stream)
    got = [next(it) for _ in range(3)]
    rid, victim = _running(stack, t0, first_token=True)
    stack.sup.kill(f"worker-{victim}")  # type: ignore[union-attr]
    started = time.time()
    with pytest.raises(openai.APIError) as exc:
        for ch in it:
            got.append(ch)
    assert time.time() - started < 10, "the error must come within a few lease periods"
    assert "lost" in str(exc.value)
    rows = stack.ledger_rows(
        f"request_id = '{rid}'", expect=lambda rows: bool(rows) and rows[0]["status"] == "failed"
    )
    assert rows[0]["status"] == "failed" and rows[0]["first_token_ts"] is not None


def test_redelivered_task_is_recorded_as_duplicate_and_not_rerun(healthy: LiveStack) -> None:
    """What RabbitMQ does on a lost connection and Redis after the visibility
    timeout: deliver a message again. The claim refuses to run it twice."""
    stack = healthy
    c = stack.client()
    resp = c.chat.completions.create(
        model=stack.model, max_tokens=3, messages=[{"role": "user", "content": "once only"}]
    )
    rid = resp.id.removeprefix("chatcmpl-")
    rows = stack.ledger_rows(
        f"request_id = '{rid}'",
        expect=lambda rows: bool(rows) and rows[0]["status"] in ("completed", "slo_missed"),
    )
    row = rows[0]
    engine_before = sum(
        e.metrics.success[r]._value.get()  # type: ignore[attr-defined]
        for e in stack.emulators.values()
        for r in e.metrics.success
    )
    queue = f"{row['dc']}.{row['instance']}.interactive"
    job = {
        "rid": rid,
        "attempt": 1,
        "tenant": row["tenant_id"],
        "tier": "interactive",
        "model": row["model"],
        "body": {
            "model": row["model"],
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        },
        "input_tokens": row["prompt_tokens"],
        "max_tokens": 3,
        "arrival_ts": row["arrival_ts"].timestamp(),
        "queue": queue,
    }
    celery = stack.app.extensions["tokenfleet.celery"]
    state = stack.gateway.state
    dups_before = state.counters().get("duplicates", 0)
    celery.send_task(
        "tokenfleet.chat", args=[job], task_id=f"{rid}.1", queue=queue, routing_key=queue
    )
    deadline = time.time() + 10
    while time.time() < deadline and state.counters().get("duplicates", 0) == dups_before:
        time.sleep(0.1)
    assert state.counters().get("duplicates", 0) == dups_before + 1
    # give a wrongly separate row time to show up (the worker flushes every 0.25 s)
    rows = stack.ledger_rows(
        f"request_id LIKE '{rid}%'", timeout_s=3, expect=lambda rows: len(rows) > 1
    )
    assert len(rows) == 1, "a redelivery is not a second request"
    again = rows[0]
    assert (
        again["status"] == row["status"] and again["completion_tokens"] == row["completion_tokens"]
    ), "the bill is unchanged"
    engine_after = sum(
        e.metrics.success[r]._value.get()  # type: ignore[attr-defined]
        for e in stack.emulators.values()
        for r in e.metrics.success
    )
    assert engine_after == engine_before, "the engine never saw the duplicate"


def test_engine_5xx_retries_elsewhere_and_marks_it_unhealthy(healthy: LiveStack) -> None:
    stack = healthy
    stack.emulators["b0"].config.fail_5xx_rate = 1.0
    c = stack.client()
    ids = []
    for i in range(6):
        resp = c.chat.completions.create(
            model=stack.model, max_tokens=3, messages=[{"role": "user", "content": f"5xx {i}"}]
        )
        ids.append(resp.id.removeprefix("chatcmpl-"))
    rows = stack.ledger_rows(
        expect=lambda rows: (
            set(ids)
            <= {r["request_id"] for r in rows if r["status"] in ("completed", "slo_missed")}
        )
    )
    mine = [r for r in rows if r["request_id"] in ids]
    assert all(r["instance"] == "a0" for r in mine), [r["instance"] for r in mine]
    assert any(r["attempts"] == 2 for r in mine), "some went to b0 first and were retried"
    info = {i.instance_id: i for i in stack.gateway.state.instances()}
    assert not info["b0"].is_healthy(time.time(), stack.live.stale_after_s)  # type: ignore[union-attr]
    assert "500" in info["b0"].unhealthy_reason


def test_engine_stall_is_detected_within_two_scrapes_and_retried(healthy: LiveStack) -> None:
    stack = healthy
    interval = stack.live.scrape_interval_s  # type: ignore[union-attr]
    c = stack.client(timeout=60)
    out: dict[str, Any] = {}

    def call() -> None:
        out["resp"] = c.chat.completions.create(
            model=stack.model, max_tokens=4, messages=[{"role": "user", "content": long_prompt()}]
        )

    t0 = time.time()
    th = threading.Thread(target=call)
    th.start()
    rid, victim = _running(stack, t0, first_token=False)
    stack.emulators[victim].loop.stall_after_s = 0.0  # the engine stops making progress
    stalled_at = time.time()
    marked = None
    while time.time() - stalled_at < 5:
        inst = {i.instance_id: i for i in stack.gateway.state.instances()}[victim]
        if not inst.metrics.healthy:
            marked = time.time() - stalled_at
            break
        time.sleep(0.02)
    assert marked is not None and marked <= 2 * interval + 0.1, marked
    th.join(60)
    assert "resp" in out
    row = stack.ledger_rows(
        f"request_id = '{rid}'",
        expect=lambda rows: bool(rows) and rows[0]["status"] in ("completed", "slo_missed"),
    )[0]
    assert row["instance"] == _other(stack, victim) and row["attempts"] == 2


def test_postgres_outage_loses_no_ledger_rows(healthy: LiveStack) -> None:
    from tokenfleet.tenancy import admin

    stack = healthy
    c = stack.client()
    # a tenant whose key lives in the database, used once before the outage
    svc = stack.app.extensions["tokenfleet.tenancy"]
    admin.create_tenant(svc.engine, "db-tenant", actor="test", cache=svc.directory)
    db_key, _ = admin.create_key(svc.engine, "db-tenant", actor="test", cache=svc.directory)
    db_client = openai.OpenAI(base_url=stack.url + "/v1", api_key=db_key, max_retries=0)
    db_client.models.list()
    stack.postgres.stop()
    try:
        ids = []
        for i in range(5):
            resp = c.chat.completions.create(
                model=stack.model,
                max_tokens=3,
                messages=[{"role": "user", "content": f"while the database is down {i}"}],
            )
            ids.append(resp.id.removeprefix("chatcmpl-"))
        # its Redis copies expire during a long outage: the API's memory still vouches
        # for the key (auth_stale_s), so the tenant is served, not refused
        prefix = svc.directory.prefix
        svc.redis.delete(
            *svc.redis.keys(f"{prefix}:apikey:*"), *svc.redis.keys(f"{prefix}:tenant:*")
        )
        time.sleep(svc.directory.local_ttl_s + 0.05)  # past the local freshness
        resp = db_client.chat.completions.create(
            model=stack.model,
            max_tokens=3,
            messages=[{"role": "user", "content": "a database tenant during the outage"}],
        )
        ids.append(resp.id.removeprefix("chatcmpl-"))
        assert svc.directory.stale_served >= 1
        with pytest.raises(openai.APIStatusError) as unknown:  # never seen: cannot be vouched for
            openai.OpenAI(
                base_url=stack.url + "/v1", api_key="tf-never-seen", max_retries=0
            ).models.list()
        assert unknown.value.status_code == 503
    finally:
        stack.postgres.start()
    rows = stack.ledger_rows(
        timeout_s=30,
        expect=lambda rows: (
            set(ids)
            <= {r["request_id"] for r in rows if r["status"] in ("completed", "slo_missed")}
        ),
    )
    done = {r["request_id"] for r in rows if r["status"] in ("completed", "slo_missed")}
    assert set(ids) <= done
    assert all(r["dispatched_ts"] and r["finished_ts"] for r in rows if r["request_id"] in ids)


def test_redis_restart_gives_503_then_recovers(healthy: LiveStack) -> None:
    stack = healthy
    body = {
        "model": stack.model,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "during the outage"}],
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    stack.redis.stop()
    try:
        r = requests.post(
            stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=15
        )
        assert r.status_code == 503, r.text
        assert 1 <= int(r.headers["Retry-After"]) <= 120
        assert r.json()["error"]["type"] == "server_error"
        refused = r.headers["X-Request-Id"]  # errors name their request too
        # /health answers from a copy Redis gave within the last second, so it
        # says "down" within about that long, not necessarily at once
        deadline = time.monotonic() + 5
        while True:
            h = requests.get(stack.url + "/health", timeout=10)
            if h.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert h.status_code == 503 and "Retry-After" in h.headers
    finally:
        stack.redis.start()
    # no restart of anything else: API and workers reconnect by themselves
    deadline = time.time() + 30
    last = None
    while time.time() < deadline:
        try:
            last = requests.post(
                stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=15
            )
            if last.status_code == 200:
                break
        except requests.RequestException as exc:
            last = exc
        time.sleep(0.5)
    assert last is not None and getattr(last, "status_code", None) == 200, last
    assert last.json()["usage"]["completion_tokens"] >= 1
    # the refusal is a request the service did not serve: a rejected row
    rows = stack.ledger_rows(f"request_id = '{refused}'", expect=bool)
    assert [r["status"] for r in rows] == ["rejected"]
