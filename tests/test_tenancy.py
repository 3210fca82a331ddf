"""Tenants, keys and quotas against real embedded Redis and PostgreSQL (no mocks).

The headline scenario: 50 requests fired at once at a tenant with 10 left
admit exactly 10, for every kind of limit, with an honest Retry-After.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.stack import API_KEY
from tests.support.stores import fresh_database
from tokenfleet.cli.main import main as cli_main
from tokenfleet.errors import ConfigError
from tokenfleet.service.db import make_engine
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis
from tokenfleet.service.ledger import ApiKey, AuditLog
from tokenfleet.tenancy import admin
from tokenfleet.tenancy.directory import TenantDirectory
from tokenfleet.tenancy.gate import TenancyError, TenancyGate
from tokenfleet.tenancy.models import TenantUsage
from tokenfleet.tenancy.quota import (
    CODE_CONCURRENCY,
    CODE_DAILY,
    CODE_RPM,
    CODE_TOO_LARGE,
    CODE_TPM,
    QuotaEnforcer,
    QuotaLimits,
)
from tokenfleet.tenancy.usage import UsageRecorder, usage_for

_ids = itertools.count()


@pytest.fixture(scope="module")
def db_url(pg: EmbeddedPostgres) -> str:
    return fresh_database(pg, "tenancy")


@pytest.fixture(scope="module")
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = make_engine(db_url, pool_size=10)
    yield eng
    eng.dispose()


@pytest.fixture
def rc(redis_server: EmbeddedRedis) -> Any:
    client = redis_server.client(max_connections=200)
    yield client
    client.close()


@pytest.fixture
def quotas(rc: Any) -> QuotaEnforcer:
    return QuotaEnforcer(rc, prefix=f"t{next(_ids)}")


def fire(n: int, fn: Any) -> list[Any]:
    """Run ``fn(i)`` in ``n`` threads released at the same instant."""
    barrier = threading.Barrier(n)

    def go(i: int) -> Any:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(go, range(n)))


# ---- the race: 50 concurrent requests, 10 left ---------------------------------
@pytest.mark.parametrize(
    "limits, prompt, max_tokens, spend, code",
    [
        (QuotaLimits(requests_per_minute=30), 10, 10, 20, CODE_RPM),
        (QuotaLimits(tokens_per_minute=3000), 50, 50, 20, CODE_TPM),
        (QuotaLimits(daily_token_budget=3000), 50, 50, 20, CODE_DAILY),
        (QuotaLimits(max_concurrent_requests=30), 1, 1, 20, CODE_CONCURRENCY),
    ],
    ids=["rpm", "tpm", "daily", "concurrency"],
)
def test_fifty_concurrent_requests_with_ten_left_admit_exactly_ten(
    quotas: QuotaEnforcer, limits: QuotaLimits, prompt: int, max_tokens: int, spend: int, code: str
) -> None:
    # use up 20 of 30 (requests or 100-token requests), leaving exactly 10
    for _ in range(spend):
        assert quotas.admit(
            "acme", "interactive", limits, prompt_tokens=prompt, max_tokens=max_tokens
        ).allowed
    results = fire(
        50,
        lambda i: quotas.admit(
            "acme", "interactive", limits, prompt_tokens=prompt, max_tokens=max_tokens
        ),
    )
    admitted = [r for r in results if r.allowed]
    rejected = [r for r in results if not r.allowed]
    # token buckets refill at limit/60 per second: over a sub-second burst that is
    # < 1 request's worth, so the count is exact
    assert len(admitted) == 10
    assert {r.code for r in rejected} == {code}
    assert all(r.retry_after_s is not None and r.retry_after_s > 0 for r in rejected)
    # the other budget is independent
    assert quotas.admit(
        "acme", "batch", limits, prompt_tokens=prompt, max_tokens=max_tokens
    ).allowed


def test_retry_after_is_when_the_bucket_has_refilled(quotas: QuotaEnforcer) -> None:
    limits = QuotaLimits(requests_per_minute=600)  # 10 per second
    for _ in range(700):  # drain the bucket (it refills while we loop)
        denied = quotas.admit("r", "interactive", limits, prompt_tokens=1, max_tokens=1)
        if not denied.allowed:
            break
    assert not denied.allowed and denied.code == CODE_RPM
    assert denied.retry_after_s is not None and 0 < denied.retry_after_s <= 0.1 + 1e-3
    assert denied.retry_after_header() == {
        "Retry-After": "1",
        "retry-after-ms": str(math.ceil(denied.retry_after_s * 1000)),
    }
    time.sleep(denied.retry_after_s + 0.02)  # honest: after the stated wait it passes
    assert quotas.admit("r", "interactive", limits, prompt_tokens=1, max_tokens=1).allowed

    tokens = QuotaLimits(tokens_per_minute=6000)  # 100 tokens per second
    assert quotas.admit("t", "interactive", tokens, prompt_tokens=3000, max_tokens=3000).allowed
    d = quotas.admit("t", "interactive", tokens, prompt_tokens=100, max_tokens=100)
    assert d.code == CODE_TPM and d.retry_after_s is not None
    assert 1.9 <= d.retry_after_s <= 2.0 + 1e-3  # 200 tokens at 100/s


def test_daily_budget_retry_after_is_next_utc_midnight(quotas: QuotaEnforcer) -> None:
    limits = QuotaLimits(daily_token_budget=1000)
    assert quotas.admit("d", "batch", limits, prompt_tokens=500, max_tokens=400).allowed
    d = quotas.admit("d", "batch", limits, prompt_tokens=100, max_tokens=100)
    assert d.code == CODE_DAILY and d.retry_after_s is not None
    now = time.time()
    to_midnight = 86400 - now % 86400
    assert abs(d.retry_after_s - to_midnight) < 5


def test_requests_that_can_never_pass_get_no_retry_after(quotas: QuotaEnforcer) -> None:
    d = quotas.admit(
        "x", "interactive", QuotaLimits(tokens_per_minute=1000), prompt_tokens=900, max_tokens=200
    )
    assert not d.allowed and d.code == CODE_TOO_LARGE and d.retry_after_s is None
    assert d.retry_after_header() == {}
    assert "lower max_tokens" in d.message()


def test_an_unlimited_admission_costs_no_redis_round_trip(quotas: QuotaEnforcer, rc: Any) -> None:
    def evals() -> int:
        stats = rc.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))

    before = evals()
    d = quotas.admit("u", "interactive", QuotaLimits(), prompt_tokens=10, max_tokens=20)
    assert d.allowed and d.ticket is not None and not d.ticket.charged
    # the tenant got limits while its request ran: still nothing to give back
    assert quotas.release(d.ticket, QuotaLimits(tokens_per_minute=100), actual_tokens=15) == 0
    assert evals() == before
    state = quotas.state("u", "interactive", QuotaLimits(tokens_per_minute=100))
    assert state.running == 0 and state.daily_tokens_used == 0


def test_reservation_is_reconciled_once_and_frees_the_slot(quotas: QuotaEnforcer) -> None:
    limits = QuotaLimits(tokens_per_minute=1000, max_concurrent_requests=1, daily_token_budget=5000)
    a = quotas.admit("c", "interactive", limits, prompt_tokens=100, max_tokens=500)
    assert a.allowed and a.ticket is not None
    busy = quotas.admit("c", "interactive", limits, prompt_tokens=1, max_tokens=1)
    assert busy.code == CODE_CONCURRENCY and busy.retry_after_s == 1.0
    state = quotas.state("c", "interactive", limits)
    assert state.running == 1 and state.daily_tokens_used == 600
    assert state.tokens_left is not None and state.tokens_left < 402
    # used 100 prompt + 50 completion of the 600 reserved: 450 come back, once
    assert quotas.release(a.ticket, limits, actual_tokens=150) == 450
    assert quotas.release(a.ticket, limits, actual_tokens=150) is None
    state = quotas.state("c", "interactive", limits)
    assert state.running == 0 and state.daily_tokens_used == 150
    assert state.tokens_left is not None and state.tokens_left >= 850
    assert quotas.admit("c", "interactive", limits, prompt_tokens=1, max_tokens=1).allowed


def test_crashed_holder_releases_its_concurrency_slot_after_the_lease(rc: Any) -> None:
    q = QuotaEnforcer(rc, prefix=f"lease{next(_ids)}", lease_s=0.3)
    limits = QuotaLimits(max_concurrent_requests=1)
    assert q.admit("z", "interactive", limits, prompt_tokens=1, max_tokens=1).allowed
    assert not q.admit("z", "interactive", limits, prompt_tokens=1, max_tokens=1).allowed
    time.sleep(0.35)  # the holder never called release()
    assert q.admit("z", "interactive", limits, prompt_tokens=1, max_tokens=1).allowed


def test_lowering_a_limit_takes_effect_on_the_next_request(quotas: QuotaEnforcer) -> None:
    assert quotas.admit(
        "l", "interactive", QuotaLimits(requests_per_minute=100), prompt_tokens=1, max_tokens=1
    ).allowed
    lowered = QuotaLimits(requests_per_minute=1)  # bucket had 99 left; capped at the new size
    assert quotas.admit("l", "interactive", lowered, prompt_tokens=1, max_tokens=1).allowed
    assert not quotas.admit("l", "interactive", lowered, prompt_tokens=1, max_tokens=1).allowed


# ---- tenants, keys, revocation ------------------------------------------------------
def test_tenant_lifecycle_keys_hashed_and_revocation_within_one_second(
    engine: sa.Engine, rc: Any
) -> None:
    directory = TenantDirectory(engine, rc, prefix="lc")
    admin.create_tenant(
        engine,
        "lifecycle",
        actor="test",
        slo_class="premium",
        allowed_models=["llama-3-8b"],
        allowed_regions=["eu-west"],
        cache=directory,
    )
    admin.set_quota(
        engine, "lifecycle", "batch", {"tokens_per_minute": 5000}, actor="test", cache=directory
    )
    key, info = admin.create_key(engine, "lifecycle", actor="test", name="ci", cache=directory)
    with engine.connect() as conn:
        stored = conn.execute(
            sa.select(ApiKey.key_sha256, ApiKey.prefix).where(ApiKey.id == info.id)
        ).one()
    assert key not in stored and stored.key_sha256 != key and key.startswith(stored.prefix)

    ctx = directory.authenticate(key)
    assert ctx is not None and ctx.id == "lifecycle" and ctx.slo_class == "premium"
    assert ctx.allowed_regions == ("eu-west",) and not ctx.allows_model("other")
    assert ctx.quotas.batch.tokens_per_minute == 5000 and ctx.quotas.interactive.unlimited

    # a second API process with warm caches
    other = TenantDirectory(engine, rc, prefix="lc")
    assert other.authenticate(key) is not None
    assert admin.revoke_key(engine, info.prefix, actor="test", cache=directory) == 1
    t0 = time.monotonic()
    while other.authenticate(key) is not None:
        assert time.monotonic() - t0 < 1.0, "revoked key still accepted after 1 s"
        time.sleep(0.02)
    assert directory.authenticate(key) is None
    assert admin.revoke_key(engine, info.prefix, actor="test", cache=directory) == 0

    with engine.connect() as conn:
        actions = [
            a
            for (a,) in conn.execute(
                sa.select(AuditLog.action)
                .where(AuditLog.payload["tenant_id"].as_string() == "lifecycle")
                .order_by(AuditLog.id)
            )
        ]
    assert actions == ["tenant.create", "tenant.set_quota", "key.create", "key.revoke"]


def test_quota_change_and_disable_reach_warm_caches_within_one_second(
    engine: sa.Engine, rc: Any
) -> None:
    directory = TenantDirectory(engine, rc, prefix="qc")
    admin.create_tenant(engine, "quotachange", actor="test")
    key, _ = admin.create_key(engine, "quotachange", actor="test")
    warm = TenantDirectory(engine, rc, prefix="qc")
    assert warm.authenticate(key) is not None
    admin.set_quota(
        engine,
        "quotachange",
        "interactive",
        {"requests_per_minute": 7},
        actor="test",
        cache=directory,
    )
    time.sleep(directory.local_ttl_s + 0.05)
    ctx = warm.authenticate(key)
    assert ctx is not None and ctx.quotas.interactive.requests_per_minute == 7
    admin.update_tenant(engine, "quotachange", actor="test", disabled=True, cache=directory)
    time.sleep(directory.local_ttl_s + 0.05)
    assert warm.authenticate(key) is None


def test_entries_past_half_their_freshness_are_read_again_off_the_request_path(
    engine: sa.Engine, rc: Any
) -> None:
    """A request finding its key and tenant past half their local freshness is
    answered from memory while one background thread reads them again: under
    steady traffic no request waits for Redis, and no entry is served older
    than ``local_ttl_s``."""
    import threading

    now = [1000.0]
    reads: list[str] = []

    class CountingRedis:
        def __getattr__(self, name: str) -> Any:
            return getattr(rc, name)

        def get(self, name: str) -> Any:
            reads.append(threading.current_thread().name)
            return rc.get(name)

    warm = TenantDirectory(engine, CountingRedis(), prefix="ahead", clock=lambda: now[0])
    admin_cache = TenantDirectory(engine, rc, prefix="ahead")
    admin.create_tenant(engine, "ahead", actor="test")
    key, _ = admin.create_key(engine, "ahead", actor="test")
    ctx = warm.authenticate(key)
    assert ctx is not None and ctx.quotas.interactive.requests_per_minute is None
    on_path = reads.count(threading.current_thread().name)
    assert on_path == 2  # the key and its tenant, read by the request
    admin.set_quota(
        engine, "ahead", "interactive", {"requests_per_minute": 7}, actor="test", cache=admin_cache
    )

    now[0] += 0.3 * warm.local_ttl_s  # still fresh: from memory, nothing read again
    assert warm.authenticate(key) is not None and not warm._refreshing
    now[0] += 0.3 * warm.local_ttl_s  # past half: from memory, read again behind it
    ctx = warm.authenticate(key)
    assert ctx is not None and ctx.quotas.interactive.requests_per_minute is None
    deadline = time.monotonic() + 10
    while warm._refreshing or reads.count("tenancy-refresh") < 2:
        assert time.monotonic() < deadline, "the background read did not happen"
        time.sleep(0.01)
    ctx = warm.authenticate(key)  # the new quota, from memory
    assert ctx is not None and ctx.quotas.interactive.requests_per_minute == 7
    assert reads.count(threading.current_thread().name) == on_path

    now[0] += 2 * warm.local_ttl_s  # unused past its freshness: read on the request path
    assert warm.authenticate(key) is not None
    assert reads.count(threading.current_thread().name) == on_path + 2


def test_auth_cache_is_bounded_unknown_keys_included(engine: sa.Engine, rc: Any) -> None:
    directory = TenantDirectory(engine, rc, prefix="bound", max_entries=20)
    admin.create_tenant(engine, "bounded", actor="test")
    key, _ = admin.create_key(engine, "bounded", actor="test")
    assert directory.authenticate(key) is not None
    for i in range(60):  # a client guessing keys
        assert directory.authenticate(f"tf-guess-{i}") is None
    assert len(directory._keys) == 20 and len(directory._tenants) == 1
    assert directory.authenticate(key) is not None  # evicted, looked up again


def test_cached_keys_keep_working_while_postgres_is_unreachable(engine: sa.Engine, rc: Any) -> None:
    from web.auth import Authenticator

    now = [1000.0]
    directory = TenantDirectory(engine, rc, prefix="pgdown", stale_s=600.0, clock=lambda: now[0])
    admin.create_tenant(engine, "pgdown", actor="test")
    key, _ = admin.create_key(engine, "pgdown", actor="test")
    auth = Authenticator({}, directory)
    assert auth.authenticate(f"Bearer {key}").tenant == "pgdown"
    # the database goes away (nothing listens on that port) and the Redis copies expire
    dead = make_engine("postgresql://postgres@127.0.0.1:9/tokenfleet")
    directory.engine = dead
    rc.delete(*rc.keys("pgdown:*"))
    try:
        # still fresh but past half: answered from memory; the background read
        # fails quietly and is not a lookup answered from stale memory
        now[0] += 0.3
        assert auth.authenticate(f"Bearer {key}").tenant == "pgdown"
        deadline = time.monotonic() + 10
        while directory._refreshing:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert directory.stale_served == 0
        now[0] += 300  # local entries are long past their 0.5 s freshness
        assert auth.authenticate(f"Bearer {key}").tenant == "pgdown"
        assert directory.stale_served == 2  # the key and its tenant, from memory
        with pytest.raises(sa.exc.OperationalError):  # never seen here: 503 at the API
            directory.authenticate("tf-never-seen-before")
        now[0] += 301  # past the stale window: no longer vouched for
        with pytest.raises(sa.exc.OperationalError):
            directory.authenticate(key)
    finally:
        dead.dispose()
        directory.engine = engine


def test_an_implicit_max_tokens_reserves_what_the_budget_has_left() -> None:
    from tokenfleet.tenancy.quota import QuotaState
    from web.quota import MIN_IMPLICIT_RESERVE, implicit_reservation

    def state(tokens_left: float | None, used: int = 0) -> Any:
        return lambda: QuotaState(None, tokens_left, 0, used)

    def fail() -> Any:
        raise AssertionError("no Redis round trip without token limits")

    assert implicit_reservation(fail, QuotaLimits(requests_per_minute=5), 10, 4096) == 4096
    tpm = QuotaLimits(tokens_per_minute=2000)
    assert implicit_reservation(state(2000.0), tpm, 5, 4096) == 1995  # "Hello!" fits
    assert implicit_reservation(state(505.0), tpm, 5, 4096) == 500
    assert implicit_reservation(state(0.0), tpm, 5, 4096) == MIN_IMPLICIT_RESERVE
    assert implicit_reservation(state(2000.0), tpm, 1995, 4096) == 5  # never "too large"
    daily = QuotaLimits(daily_token_budget=10_000)
    assert implicit_reservation(state(None, used=9_000), daily, 100, 4096) == 900
    assert implicit_reservation(state(None), daily, 100, 300) == 300  # context left


def test_api_authenticates_and_gate_checks_models_and_answers_openai_errors(
    engine: sa.Engine, rc: Any
) -> None:
    from web.auth import Authenticator
    from web.errors import ApiError

    directory = TenantDirectory(engine, rc, prefix="gate")
    auth = Authenticator({}, directory)
    gate = TenancyGate(
        directory, QuotaEnforcer(rc, prefix="gate"), UsageRecorder(rc, engine, prefix="gate")
    )
    admin.create_tenant(engine, "gated", actor="test", allowed_models=["m1"])
    admin.set_quota(engine, "gated", "interactive", {"requests_per_minute": 1}, actor="test")
    key, _ = admin.create_key(engine, "gated", actor="test")

    with pytest.raises(ApiError) as bad:
        auth.authenticate("Bearer tf-not-a-key")
    assert bad.value.status == 401 and bad.value.body()["error"]["code"] == "invalid_api_key"
    ctx = auth.authenticate(f"Bearer {key}").context
    assert ctx is not None and ctx.id == "gated"
    with pytest.raises(TenancyError) as e:
        gate.admit(ctx, "interactive", model="m2", prompt_tokens=1, max_tokens=1)
    assert e.value.status == 404 and e.value.code == "model_not_found"

    adm = gate.admit(ctx, "interactive", model="m1", prompt_tokens=10, max_tokens=100)
    with pytest.raises(TenancyError) as e:
        gate.admit(ctx, "interactive", model="m1", prompt_tokens=10, max_tokens=100)
    err = e.value
    assert err.status == 429 and err.code == CODE_RPM and err.param == "requests_per_minute"
    assert err.body()["error"]["type"] == "rate_limit_error"
    assert 55 <= int(err.headers["Retry-After"]) <= 60
    gate.finish(adm, completion_tokens=42)
    gate.finish(adm, completion_tokens=42)  # idempotent
    assert gate.usage is not None and gate.usage.flush() == 1
    rows = usage_for(engine, "gated")
    assert rows == [
        {
            "day": datetime.now(UTC).date().isoformat(),
            "budget": "interactive",
            "requests": 1,
            "rejected": 1,
            "prompt_tokens": 10,
            "completion_tokens": 42,
        }
    ]


def test_usage_is_buffered_one_row_per_tenant_and_day_per_flush(engine: sa.Engine, rc: Any) -> None:
    rec = UsageRecorder(rc, engine, prefix="usage")
    fire(
        20,
        lambda i: [
            rec.record(f"u{i % 2}", "batch", requests=1, prompt_tokens=3, completion_tokens=5)
            for _ in range(50)
        ],
    )
    assert rec.flush() == 2  # 1,000 requests -> 2 row upserts
    rec.record("u0", "batch", requests=1, prompt_tokens=3)
    assert rec.flush() == 1 and rec.flush() == 0
    with engine.connect() as conn:
        rows = {
            r.tenant_id: r
            for r in conn.execute(
                sa.select(TenantUsage).where(TenantUsage.tenant_id.in_(["u0", "u1"]))
            )
        }
    assert rows["u0"].requests == 501 and rows["u0"].prompt_tokens == 1503
    assert rows["u1"].requests == 500 and rows["u1"].completion_tokens == 2500


def test_a_flush_never_writes_a_hash_another_flusher_is_writing(engine: sa.Engine, rc: Any) -> None:
    """Two flushers (the API's thread and an explicit flush, or two API processes):
    one that finds another's claimed hash leaves it alone until it is abandoned
    (failed once in a clean-clone run: a tenant's three batch lines counted six)."""
    import time

    from tokenfleet.tenancy.usage import ABANDONED_AFTER_S

    a = UsageRecorder(rc, engine, prefix="race")
    b = UsageRecorder(rc, engine, prefix="race")
    a.record("r0", "interactive", requests=3)
    in_progress = a._claim(a.pending_key)  # a renamed it away and is writing it now
    assert in_progress is not None
    assert b.flush() == 0, "b must not write what a is writing"
    assert a._flush_key(in_progress) == 1
    # a hash whose flusher died after its RENAME is taken over, by one flusher only
    a.record("r1", "interactive", requests=2)
    dead = f"{a.flushing_prefix}{time.time() - ABANDONED_AFTER_S - 1:.3f}:x"
    rc.rename(a.pending_key, dead)
    assert b.flush() == 1 and a.flush() == 0
    with engine.connect() as conn:
        got = {
            r.tenant_id: r.requests
            for r in conn.execute(
                sa.select(TenantUsage).where(TenantUsage.tenant_id.in_(["r0", "r1"]))
            )
        }
    assert got == {"r0": 3, "r1": 2}


# ---- CLI ----------------------------------------------------------------------------
def test_cli_create_list_set_quota_and_keys(
    db_url: str,
    redis_server: EmbeddedRedis,
    engine: sa.Engine,
    rc: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stores = ["--database-url", db_url, "--redis-url", redis_server.url]
    assert (
        cli_main(
            [
                "tenants",
                "create",
                "cli-co",
                "--models",
                "a,b",
                "--regions",
                "us",
                "--rpm",
                "60",
                "--with-key",
                *stores,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    key = out.strip().splitlines()[-1].split(": ")[-1]
    assert key.startswith("tf-")
    assert (
        cli_main(
            [
                "tenants",
                "set-quota",
                "cli-co",
                "--budget",
                "batch",
                "--tpm",
                "9000",
                "--daily-tokens",
                "100000",
                *stores,
            ]
        )
        == 0
    )
    assert "tpm=9000" in capsys.readouterr().out
    assert cli_main(["tenants", "set-quota", "cli-co", "--rpm", "none", *stores]) == 0
    assert cli_main(["tenants", "list", "--json", *stores]) == 0
    import json

    listed = {t["id"]: t for t in json.loads(capsys.readouterr().out.split("\n", 1)[1])}
    t = listed["cli-co"]
    assert t["allowed_models"] == ["a", "b"] and t["active_keys"] == 1
    assert t["quotas"]["interactive"]["requests_per_minute"] is None
    assert t["quotas"]["batch"] == {
        "requests_per_minute": None,
        "tokens_per_minute": 9000,
        "max_concurrent_requests": None,
        "daily_token_budget": 100000,
    }
    assert cli_main(["tenants", "keys", "create", "cli-co", "-q", *stores]) == 0
    key2 = capsys.readouterr().out.strip()
    directory = TenantDirectory(engine, rc)
    assert directory.authenticate(key2) is not None
    assert cli_main(["tenants", "keys", "revoke", key2, *stores]) == 0
    time.sleep(directory.local_ttl_s + 0.05)  # this process' own memory cache
    assert directory.authenticate(key2) is None
    assert directory.authenticate(key) is not None
    # errors are one line with the fix
    assert cli_main(["tenants", "keys", "revoke", "tf-nope", *stores]) == 2
    assert "tokenfleet tenants keys list" in capsys.readouterr().err
    assert cli_main(["tenants", "create", "Bad Id", *stores]) == 2
    assert "a-z, 0-9" in capsys.readouterr().err


def test_admin_rejects_bad_input(engine: sa.Engine) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        admin.set_quota(engine, "ghost", "interactive", {"requests_per_minute": 1}, actor="t")
    admin.create_tenant(engine, "strict", actor="t")
    with pytest.raises(ConfigError, match="unknown budget"):
        admin.set_quota(engine, "strict", "gold", {}, actor="t")
    with pytest.raises(ConfigError, match="non-negative"):
        admin.set_quota(engine, "strict", "batch", {"requests_per_minute": -1}, actor="t")
    with pytest.raises(ConfigError, match="already exists"):
        admin.create_tenant(engine, "strict", actor="t")


# ---- through the live HTTP API (real workers and engines) ------------------------------------
@pytest.fixture(scope="module")
def live(live_stack: Any) -> Iterator[Any]:
    with live_stack(router="round_robin", time_scale=0.02) as stack:
        yield stack
        stack.app.extensions["tokenfleet.tenancy"].close()


def _tenant_with_rpm(svc: Any, tenant: str, rpm: int) -> tuple[str, Any]:
    """A new tenant allowed ``rpm`` interactive requests a minute, and its key."""
    admin.create_tenant(svc.engine, tenant, actor="test", cache=svc.directory)
    admin.set_quota(
        svc.engine,
        tenant,
        "interactive",
        {"requests_per_minute": rpm},
        actor="test",
        cache=svc.directory,
    )
    return admin.create_key(svc.engine, tenant, actor="test", cache=svc.directory)


def test_api_admits_exactly_ten_of_fifty_concurrent_chats_and_revokes_in_a_second(
    live: Any,
) -> None:
    import requests

    svc = live.app.extensions["tokenfleet.tenancy"]
    key, info = _tenant_with_rpm(svc, "http-co", 10)
    body = {"model": live.model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    url = live.url + "/v1/chat/completions"

    def post(i: int) -> Any:
        return requests.post(url, json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})

    results = fire(50, post)
    ok = [r for r in results if r.status_code == 200]
    limited = [r for r in results if r.status_code == 429]
    assert len(ok) == 10 and len(limited) == 40, sorted(r.status_code for r in results)
    assert all(r.json()["choices"][0]["message"]["role"] == "assistant" for r in ok)
    for r in limited:
        err = r.json()["error"]
        assert err["code"] == "requests_per_minute_exceeded" and err["type"] == "rate_limit_error"
        # one request refills in 6 s at 10/min: the wait is honest, not a constant
        assert 1 <= int(r.headers["Retry-After"]) <= 6
        assert 0 < int(r.headers["retry-after-ms"]) <= 6000
    # usage reached PostgreSQL through the buffered flush
    svc.usage.flush()
    day = usage_for(svc.engine, "http-co")[0]
    assert day["requests"] == 10 and day["rejected"] == 40 and day["completion_tokens"] > 0
    # each 429 is a request the service did not serve: one rejected ledger row,
    # named by the X-Request-Id of its answer (attainment counts it)
    refused = {r.headers["X-Request-Id"] for r in limited}
    assert len(refused) == 40
    rows = live.ledger_rows(
        "tenant_id = 'http-co'",
        expect=lambda rows: sum(r["status"] == "rejected" for r in rows) >= 40,
    )
    assert {r["request_id"] for r in rows if r["status"] == "rejected"} == refused

    # revocation: the API refuses the key within a second
    admin.set_quota(
        svc.engine,
        "http-co",
        "interactive",
        {"requests_per_minute": None},
        actor="test",
        cache=svc.directory,
    )
    time.sleep(svc.directory.local_ttl_s + 0.05)
    assert post(0).status_code == 200
    other = TenantDirectory(svc.engine, svc.redis, prefix=svc.directory.prefix)
    admin.revoke_key(engine=other.engine, key=str(info.id), actor="test", cache=other)
    t0 = time.monotonic()
    while (code := post(0).status_code) != 401:
        assert code == 200 and time.monotonic() - t0 < 1.0, "revoked key still served after 1 s"
    assert time.monotonic() - t0 < 1.0


def test_two_api_replicas_admit_exactly_ten_of_fifty_concurrent_chats(live: Any) -> None:
    """The quota is one Redis script, so replicas behind a load balancer share
    it: 50 concurrent requests spread over two API processes, 10 left, admit 10."""
    import requests

    svc = live.app.extensions["tokenfleet.tenancy"]
    key, _ = _tenant_with_rpm(svc, "replica-co", 10)
    # the second replica: a `tokenfleet api` process of its own on the same stores
    urls = [live.url, live.start_api_process("api-replica-2")]
    body = {"model": live.model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}

    def post(i: int) -> tuple[int, Any]:
        r = requests.post(
            urls[i % 2] + "/v1/chat/completions",
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {key}"},
        )
        return i % 2, r

    for url in urls:  # each replica's first request (imports, connections) is not part of the race
        warm = requests.post(
            url + "/v1/chat/completions",
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {API_KEY}"},  # another tenant's key
        )
        assert warm.status_code == 200, warm.text
    results = fire(50, post)
    codes = sorted(r.status_code for _, r in results)
    assert codes.count(200) == 10 and codes.count(429) == 40, [
        r.text for _, r in results if r.status_code not in (200, 429)
    ]
    for replica in (0, 1):
        mine = [r for k, r in results if k == replica]
        assert len(mine) == 25 and all(r.status_code in (200, 429) for r in mine)
    for _, r in results:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "requests_per_minute_exceeded"
    # each refusal is one rejected row, whichever replica refused it
    refused = {r.headers["X-Request-Id"] for _, r in results if r.status_code == 429}
    rows = live.ledger_rows(
        "tenant_id = 'replica-co'",
        expect=lambda rows: sum(r["status"] == "rejected" for r in rows) >= 40,
    )
    assert {r["request_id"] for r in rows if r["status"] == "rejected"} == refused
    # each replica counts the other by its heartbeat (what turns the booking check on)
    gw = live.gateway
    deadline = time.monotonic() + 5.0
    while gw.peer_apis < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gw.peer_apis >= 1


def test_a_request_without_max_tokens_fits_a_small_budget_and_says_why_it_does_not(
    live: Any,
) -> None:
    import requests

    svc = live.app.extensions["tokenfleet.tenancy"]
    admin.create_tenant(svc.engine, "small-co", actor="test", cache=svc.directory)
    admin.set_quota(
        svc.engine,
        "small-co",
        "interactive",
        {"tokens_per_minute": 2000},
        actor="test",
        cache=svc.directory,
    )
    key, _ = admin.create_key(svc.engine, "small-co", actor="test", cache=svc.directory)
    url = live.url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}
    hello = {"model": live.model, "messages": [{"role": "user", "content": "Hello!"}]}
    r = requests.post(url, json=hello, headers=headers, timeout=60)
    assert r.status_code == 200, r.text  # 4,096 reserved used to make this a 400
    big = {"model": live.model, "messages": [{"role": "user", "content": "word " * 3000}]}
    r = requests.post(url, json=big, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "request_exceeds_quota"
    assert "set no max_tokens" in err["message"] and "set max_tokens" in err["message"]
