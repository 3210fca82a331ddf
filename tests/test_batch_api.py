"""Files + Batches API (OpenAI-compatible) against real Redis, PostgreSQL and an emulated engine.

Covers: the official ``openai`` client end to end, validation errors that
name the line, two-tenant isolation on every endpoint, cancel, quota-gated
release, and exactly one output or error line per input line when a runner
dies mid-batch (in-process here; the 5,000-line kill -9 version is below).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from werkzeug.serving import make_server

from tests.support.stores import fresh_database
from tokenfleet.batch.executors import FunctionExecutor, HttpExecutor, LineResult
from tokenfleet.batch.jobs import line_counts
from tokenfleet.batch.release import BatchDemand, plan_release
from tokenfleet.batch.runner import BatchRunner, RunnerConfig
from tokenfleet.emulator.server import EmulatorServer
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis
from tokenfleet.service.ledger import BatchLine
from tokenfleet.tenancy import admin
from web.batch_api import init_app
from web.batch_api.services import TenancyServices

REPO = Path(__file__).resolve().parents[1]
_names = itertools.count()


# ---- fixtures ------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorServer]:
    srv = EmulatorServer("llama3-8b-h200", time_scale=0.002)
    srv.start()
    yield srv
    srv.stop()


class Env:
    """One app (no runner thread: tests drive runners) and two tenants."""

    def __init__(self, app: Flask, svc: TenancyServices, model: str) -> None:
        self.app = app
        self.svc = svc
        self.client = app.test_client()
        self.model = model
        self.keys: dict[str, str] = {}
        for t in ("alpha", "beta"):
            admin.create_tenant(svc.engine, t, actor="test")
            self.keys[t], _ = admin.create_key(svc.engine, t, actor="test")

    def h(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def upload(self, tenant: str, content: bytes, name: str = "in.jsonl") -> dict[str, Any]:
        r = self.client.post(
            "/v1/files",
            headers=self.h(tenant),
            data={"purpose": "batch", "file": (io.BytesIO(content), name)},
            content_type="multipart/form-data",
        )
        assert r.status_code == 200, r.get_json()
        return r.get_json()

    def create(self, tenant: str, file_id: str) -> dict[str, Any]:
        r = self.client.post(
            "/v1/batches",
            headers=self.h(tenant),
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert r.status_code == 200, r.get_json()
        return r.get_json()

    def get(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return self.client.get(f"/v1/batches/{batch_id}", headers=self.h(tenant)).get_json()

    def content(self, tenant: str, file_id: str) -> list[dict[str, Any]]:
        r = self.client.get(f"/v1/files/{file_id}/content", headers=self.h(tenant))
        assert r.status_code == 200
        return [json.loads(x) for x in r.data.decode().splitlines()]


@pytest.fixture
def env(
    pg: EmbeddedPostgres, redis_server: EmbeddedRedis, data_dir: Path, emulator: EmulatorServer
) -> Iterator[Env]:
    n = next(_names)
    name = f"batch{os.getpid()}_{n}"
    url = fresh_database(pg, name)
    app = Flask(f"batch-test-{n}")
    init_app(
        app,
        DATABASE_URL=url,
        REDIS_URL=redis_server.url,
        DATA_DIR=str(data_dir / f"d{n}"),
        BATCH_RUNNER=False,
        USAGE_FLUSH_S=0.2,
        REDIS_PREFIX=f"b{os.getpid()}_{n}",
    )
    svc = app.extensions["tokenfleet.tenancy"]
    yield Env(app, svc, emulator.model_name)
    svc.close()
    svc.engine.dispose()
    pg.drop_database(name)  # the session's server: keep its disk small


def jsonl(model: str, n: int, *, start: int = 0, max_tokens: int = 4) -> bytes:
    return "".join(
        json.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"question {i}"}],
                },
            }
        )
        + "\n"
        for i in range(start, start + n)
    ).encode()


def runner(env: Env, executor: Any, **cfg: Any) -> BatchRunner:
    return BatchRunner(
        env.svc.engine,
        env.svc.files,
        executor,
        gate=env.svc.gate,
        config=RunnerConfig(**{"max_inflight": 16, "poll_s": 0.02, "housekeeping_s": 0.05, **cfg}),
    )


def run_until_done(
    env: Env, r: BatchRunner, tenant: str, batch_id: str, timeout_s: float = 60.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r.tick()
        b = env.get(tenant, batch_id)
        if b["status"] in ("completed", "failed", "expired", "cancelled"):
            return b
        time.sleep(0.01)
    raise AssertionError(f"batch not finished: {env.get(tenant, batch_id)}")


def outputs_by_custom_id(
    env: Env, tenant: str, b: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    seen: dict[str, list[dict[str, Any]]] = {}
    for fid in (b["output_file_id"], b["error_file_id"]):
        if fid:
            for rec in env.content(tenant, fid):
                seen.setdefault(rec["custom_id"], []).append(rec)
    return seen


# ---- the official client, end to end -------------------------------------------------
def test_official_openai_client_round_trip(env: Env, emulator: EmulatorServer) -> None:
    openai = pytest.importorskip("openai")
    srv = make_server("127.0.0.1", 0, env.app, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    r = runner(env, HttpExecutor(emulator.base_url))
    r.start()
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{srv.server_port}/v1",
            api_key=env.keys["alpha"],
            max_retries=0,
        )
        f = client.files.create(file=("questions.jsonl", jsonl(env.model, 25)), purpose="batch")
        assert f.purpose == "batch" and f.bytes > 0
        b = client.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert b.status == "in_progress" and b.request_counts.total == 25
        deadline = time.monotonic() + 60
        while b.status not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.1)
            b = client.batches.retrieve(b.id)
        assert b.status == "completed", b
        assert b.request_counts.completed == 25 and b.request_counts.failed == 0
        assert b.metadata == {"job": "nightly"} and b.error_file_id is None
        lines = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(25))
        first = lines[0]
        assert first["response"]["status_code"] == 200 and first["error"] is None
        assert first["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
        assert [x.id for x in client.batches.list()] == [b.id]
        assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    finally:
        r.stop()
        srv.shutdown()


# ---- validation errors name the line ------------------------------------------------------
def _line(cid: str, model: str, url: str = "/v1/chat/completions") -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": "x"}]},
        }
    )


@pytest.mark.parametrize(
    "kind, line, code",
    [
        ("bad_json", 3, "invalid_json"),
        ("wrong_endpoint", 2, "mismatched_endpoint"),
        ("duplicate", 4, "duplicate_custom_id"),
        ("no_custom_id", 1, "missing_custom_id"),
    ],
)
def test_invalid_input_fails_the_batch_naming_the_line(
    env: Env, kind: str, line: int, code: str
) -> None:
    m = env.model
    rows = {
        "bad_json": [_line("a", m), _line("b", m), '{"custom_id": "c", "body": {', _line("d", m)],
        "wrong_endpoint": [_line("a", m), _line("b", m, "/v1/embeddings")],
        "duplicate": [_line("a", m), _line("b", m), _line("c", m), _line("b", m)],
        "no_custom_id": [
            json.dumps(
                {
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": m, "messages": []},
                }
            )
        ],
    }[kind]
    f = env.upload("alpha", ("\n".join(rows) + "\n").encode())
    b = env.create("alpha", f["id"])
    assert b["status"] == "failed" and b["failed_at"] is not None
    err = b["errors"]["data"][0]
    assert err["code"] == code and err["line"] == line
    assert f"line {line}" in err["message"]
    with env.svc.engine.connect() as conn:  # nothing half-stored
        assert (
            conn.execute(
                sa.select(sa.func.count())
                .select_from(BatchLine)
                .where(BatchLine.batch_id == b["id"])
            ).scalar_one()
            == 0
        )


def test_more_than_50000_lines_fail_fast_naming_line_50001(env: Env) -> None:
    row = _line("{i}", env.model).replace('"{i}"', '"%d"')
    content = "".join(row % i + "\n" for i in range(50_001)).encode()
    f = env.upload("alpha", content)
    t0 = time.monotonic()
    b = env.create("alpha", f["id"])
    assert b["status"] == "failed"
    assert b["errors"]["data"][0] | {"message": ""} == {
        "code": "too_many_lines",
        "line": 50_001,
        "param": None,
        "message": "",
    }
    assert time.monotonic() - t0 < 20


def test_request_errors_are_openai_shaped(env: Env) -> None:
    c, h = env.client, env.h("alpha")
    r = c.post(
        "/v1/batches",
        headers=h,
        json={
            "input_file_id": "file-nope",
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert r.status_code == 404 and r.get_json()["error"]["param"] == "input_file_id"
    f = env.upload("alpha", jsonl(env.model, 1))
    for body, param in (
        (dict(endpoint="/v1/embeddings"), "endpoint"),
        (dict(completion_window="1h"), "completion_window"),
        (dict(metadata={"k": 1}), "metadata"),
    ):
        r = c.post(
            "/v1/batches",
            headers=h,
            json={
                "input_file_id": f["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                **body,
            },
        )
        assert r.status_code == 400 and r.get_json()["error"]["param"] == param
    r = c.post(
        "/v1/files",
        headers=h,
        data={"purpose": "fine-tune", "file": (io.BytesIO(b"{}"), "x.jsonl")},
    )
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "purpose"
    r = c.post(
        "/v1/files", headers=h, data={"purpose": "batch", "file": (io.BytesIO(b"{}"), "x.csv")}
    )
    assert r.status_code == 400
    r = c.get("/v1/batches", headers={"Authorization": "Bearer tf-wrong"})
    assert r.status_code == 401 and r.get_json()["error"]["code"] == "invalid_api_key"


# ---- isolation: every endpoint, two tenants -----------------------------------------------
def test_tenants_see_only_their_own_files_batches_and_usage(
    env: Env, emulator: EmulatorServer
) -> None:
    c = env.client
    fa = env.upload("alpha", jsonl(env.model, 3))
    fb = env.upload("beta", jsonl(env.model, 2))
    ba = env.create("alpha", fa["id"])
    run_until_done(env, runner(env, HttpExecutor(emulator.base_url)), "alpha", ba["id"])
    ba = env.get("alpha", ba["id"])
    out_id = ba["output_file_id"]
    hb = env.h("beta")
    # every read/write of alpha's objects by beta is a 404, like an unknown id
    for method, path in [
        ("GET", f"/v1/files/{fa['id']}"),
        ("GET", f"/v1/files/{fa['id']}/content"),
        ("DELETE", f"/v1/files/{fa['id']}"),
        ("GET", f"/v1/files/{out_id}"),
        ("GET", f"/v1/files/{out_id}/content"),
        ("GET", f"/v1/batches/{ba['id']}"),
        ("POST", f"/v1/batches/{ba['id']}/cancel"),
    ]:
        r = c.open(path, method=method, headers=hb)
        assert r.status_code == 404, (method, path, r.status_code)
        unknown = c.open(
            path.replace(fa["id"], "file-x").replace(out_id, "file-y").replace(ba["id"], "batch_z"),
            method=method,
            headers=hb,
        )
        assert unknown.status_code == 404
        assert set(r.get_json()["error"]) == set(unknown.get_json()["error"])
    r = c.post(
        "/v1/batches",
        headers=hb,
        json={
            "input_file_id": fa["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert r.status_code == 404
    assert [x["id"] for x in c.get("/v1/files", headers=hb).get_json()["data"]] == [fb["id"]]
    assert c.get("/v1/batches", headers=hb).get_json()["data"] == []
    assert {x["id"] for x in c.get("/v1/files", headers=env.h("alpha")).get_json()["data"]} == {
        fa["id"],
        out_id,
    }
    # usage: alpha's three requests are alpha's alone
    env.svc.usage.flush()
    ua = c.get("/v1/usage", headers=env.h("alpha")).get_json()
    ub = c.get("/v1/usage", headers=hb).get_json()
    assert ua["tenant"] == "alpha" and sum(d["requests"] for d in ua["daily"]) == 3
    assert ub["tenant"] == "beta" and ub["daily"] == []


# ---- cancel, quotas, exactly-once --------------------------------------------------------
def test_cancel_ends_pending_lines_in_the_error_file(env: Env) -> None:
    gate = threading.Event()

    def slow(tenant: str, body: dict[str, Any], rid: str) -> LineResult:
        gate.wait(10)
        return LineResult(200, {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}, rid)

    f = env.upload("alpha", jsonl(env.model, 30))
    b = env.create("alpha", f["id"])
    r = runner(env, FunctionExecutor(slow), max_inflight=4)
    r.tick()  # 4 lines in flight, blocked
    assert r.inflight() == 4
    cancelled = env.client.post(f"/v1/batches/{b['id']}/cancel", headers=env.h("alpha")).get_json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    gate.set()
    b = run_until_done(env, r, "alpha", b["id"])
    assert b["status"] == "cancelled" and b["cancelled_at"] is not None
    assert b["request_counts"]["completed"] == 4
    seen = outputs_by_custom_id(env, "alpha", b)
    assert sorted(seen) == sorted(f"req-{i}" for i in range(30))
    assert all(len(v) == 1 for v in seen.values())
    errors = [v[0] for v in seen.values() if v[0]["error"]]
    assert len(errors) == 26 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    r.stop()
    r2 = env.client.post(f"/v1/batches/{b['id']}/cancel", headers=env.h("alpha"))
    assert r2.status_code == 200 and r2.get_json()["status"] == "cancelled"


def test_batch_budget_throttles_release_without_failing_lines(env: Env) -> None:
    admin.set_quota(
        env.svc.engine,
        "beta",
        "batch",
        {"max_concurrent_requests": 2},
        actor="test",
        cache=env.svc.directory,
    )
    peak = {"now": 0, "max": 0}
    lock = threading.Lock()

    def counted(tenant: str, body: dict[str, Any], rid: str) -> LineResult:
        with lock:
            peak["now"] += 1
            peak["max"] = max(peak["max"], peak["now"])
        time.sleep(0.02)
        with lock:
            peak["now"] -= 1
        return LineResult(
            200,
            {"usage": {"prompt_tokens": 3, "completion_tokens": 2}},
            rid,
            prompt_tokens=3,
            completion_tokens=2,
        )

    f = env.upload("beta", jsonl(env.model, 12))
    b = env.create("beta", f["id"])
    r = runner(env, FunctionExecutor(counted), max_inflight=8)
    r.start()
    b = run_until_done(env, r, "beta", b["id"])
    r.stop()
    assert b["status"] == "completed" and b["request_counts"]["completed"] == 12
    assert peak["max"] == 2, "the batch budget's concurrency limit was overshot"
    assert r.stats["quota_deferred"] > 0


def test_transient_errors_retry_and_final_errors_go_to_the_error_file(env: Env) -> None:
    calls: dict[str, int] = {}

    def flaky(tenant: str, body: dict[str, Any], rid: str) -> LineResult:
        text = body["messages"][0]["content"]
        calls[text] = calls.get(text, 0) + 1
        if text == "question 0" and calls[text] < 3:
            return LineResult(503, {"error": {"message": "busy"}}, rid, transient=True)
        if text == "question 1":
            return LineResult(
                400,
                {
                    "error": {
                        "message": "bad",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
                rid,
            )
        return LineResult(200, {"ok": True}, rid)

    f = env.upload("alpha", jsonl(env.model, 3))
    b = env.create("alpha", f["id"])
    b = run_until_done(env, runner(env, FunctionExecutor(flaky)), "alpha", b["id"])
    assert b["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert calls["question 0"] == 3
    err = env.content("alpha", b["error_file_id"])
    assert [(e["custom_id"], e["response"]["status_code"]) for e in err] == [("req-1", 400)]


def test_runner_killed_midway_every_line_yields_exactly_one_result(env: Env) -> None:
    """In-process version: runner 1 claims lines and vanishes; runner 2 reaps them."""
    hold = threading.Event()

    def stuck(tenant: str, body: dict[str, Any], rid: str) -> LineResult:
        hold.wait(30)
        return LineResult(200, {"late": True}, rid)

    f = env.upload("alpha", jsonl(env.model, 40))
    b = env.create("alpha", f["id"])
    dead = runner(env, FunctionExecutor(stuck), max_inflight=10, lease_s=0.3)
    dead.tick()
    assert line_counts(env.svc.engine, b["id"])["running"] == 10
    # runner 1 "dies": it never renews, never records

    done = runner(
        env, FunctionExecutor(lambda t, body, rid: LineResult(200, {"ok": 1}, rid)), lease_s=0.3
    )
    b = run_until_done(env, done, "alpha", b["id"])
    assert done.stats["reaped"] >= 10
    hold.set()  # the zombie finishes late: its results must not be recorded
    time.sleep(0.1)
    assert dead.flush() == 10
    assert env.get("alpha", b["id"])["request_counts"] == {
        "total": 40,
        "completed": 40,
        "failed": 0,
    }
    seen = outputs_by_custom_id(env, "alpha", b)
    assert len(seen) == 40 and all(
        len(v) == 1 and v[0]["response"]["body"] == {"ok": 1} for v in seen.values()
    )


# ---- release policy (pure) ----------------------------------------------------------------
def test_release_shares_slots_evenly_and_promotes_batches_running_out_of_slack() -> None:
    relaxed = dict(seconds_to_deadline=80_000.0, line_service_s=1.0)
    plan = plan_release(
        [BatchDemand("big", 10_000, 0, **relaxed), BatchDemand("small", 3, 0, **relaxed)],
        normal_slots=8,
    )
    assert plan.grants == {"big": 5, "small": 3} and not plan.promoted
    # the same big batch with an hour left and 10,000 s of work at 8 slots: promoted,
    # served first and allowed beyond the batch share
    late = BatchDemand("late", 10_000, 0, seconds_to_deadline=3_600.0, line_service_s=8.0)
    plan = plan_release(
        [late, BatchDemand("small", 3, 0, **relaxed)], normal_slots=8, promoted_slots=8
    )
    assert plan.promoted == {"late"} and plan.grants == {"late": 16}
    # slack shrinks as the deadline nears: not promoted at first, promoted later
    d = dict(remaining_lines=1_000, inflight_lines=0, line_service_s=1.0)
    assert not plan_release(
        [BatchDemand("x", seconds_to_deadline=20_000.0, **d)], normal_slots=4
    ).promoted
    assert plan_release(
        [BatchDemand("x", seconds_to_deadline=300.0, **d)], normal_slots=4
    ).promoted == {"x"}


# ---- 5,000 lines, a runner process killed with SIGKILL midway ---------------------------------
# In the default run on purpose: the durability acceptance (about 30 s).
def test_5000_line_batch_survives_a_killed_runner_process(
    env: Env, emulator: EmulatorServer, redis_server: EmbeddedRedis
) -> None:
    n = 5000
    f = env.upload("alpha", jsonl(env.model, n, max_tokens=2))
    b = env.create("alpha", f["id"])
    db_url = env.svc.engine.url.render_as_string(hide_password=False)
    cmd = [
        sys.executable,
        "-m",
        "tokenfleet.cli.main",
        "batch",
        "runner",
        "--engine-url",
        emulator.base_url,
        "--database-url",
        db_url,
        "--redis-url",
        redis_server.url,
        "--files-dir",
        str(env.svc.files.root),
        "--max-inflight",
        "32",
        "--lease-s",
        "2",
    ]
    env_vars = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(cmd, env=env_vars, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            c = env.get("alpha", b["id"])["request_counts"]
            # kill with lines in flight: between two claims the runner may hold none
            if (
                c["completed"] >= n * 0.4
                and line_counts(env.svc.engine, b["id"]).get("running", 0) > 0
            ):
                break
            time.sleep(0.1)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        counts = line_counts(env.svc.engine, b["id"])
        assert counts.get("running", 0) > 0, "kill did not catch lines in flight"
        second = subprocess.Popen(
            cmd, env=env_vars, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            # its own generous deadline: on a loaded 2-core box the first phase may
            # have used most of its 120 s, and a shared one would fail on time alone
            deadline = time.monotonic() + 300
            done = env.get("alpha", b["id"])
            while done["status"] != "completed" and time.monotonic() < deadline:
                time.sleep(0.2)
                done = env.get("alpha", b["id"])
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
    out = env.content("alpha", done["output_file_id"])
    assert len(out) == n
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))


# ---- through the live path: SLOMax/router/Celery workers/engines --------------------------
def test_batch_lines_run_through_the_live_path_in_the_batch_tier(live_stack: Any) -> None:
    openai = pytest.importorskip("openai")
    from tests.support.stack import API_KEY, TENANT
    from web.batch_api import start_runner

    with live_stack(router="round_robin", time_scale=0.02) as stack:
        svc = stack.app.extensions["tokenfleet.tenancy"]
        start_runner(stack.app)
        try:
            client = openai.OpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0)
            f = client.files.create(
                file=("live.jsonl", jsonl(stack.model, 30, max_tokens=5)), purpose="batch"
            )
            b = client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            deadline = time.monotonic() + 60
            while b.status not in ("completed", "failed") and time.monotonic() < deadline:
                time.sleep(0.2)
                b = client.batches.retrieve(b.id)
            assert b.status == "completed" and b.request_counts.completed == 30, b
            out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
            assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(30))
            rids = {x["response"]["request_id"] for x in out}
            rows = stack.ledger_rows(
                expect=lambda rows: (
                    rids
                    <= {r["request_id"] for r in rows if r["status"] in ("completed", "slo_missed")}
                )
            )
            mine = [r for r in rows if r["request_id"] in rids]
            assert len(mine) == 30
            assert {r["tier"] for r in mine} == {"batch"} and {r["tenant_id"] for r in mine} == {
                TENANT
            }
            assert {r["instance"] for r in mine} <= {"a0", "b0"}
        finally:
            svc.close()


# ---- schemathesis against the app's /openapi.json (bounded examples) -------------------------
def test_schemathesis_finds_no_server_errors_or_schema_violations(
    pg: EmbeddedPostgres, redis_server: EmbeddedRedis, data_dir: Path
) -> None:
    pytest.importorskip(
        "schemathesis",
        reason="schemathesis is not installed "
        "(pip install schemathesis; it belongs in the dev extras)",
    )
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.openapi import from_wsgi
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        ignored_auth,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    from web import close_app, create_app

    url = fresh_database(pg, f"schema{os.getpid()}")
    app = create_app(
        {
            "REDIS_URL": redis_server.url,
            "DATABASE_URL": url,
            "DATA_DIR": str(data_dir / "schema"),
            "ADMISSION": "none",
            "BATCH_RUNNER": False,
        }
    )
    try:
        svc = app.extensions["tokenfleet.tenancy"]
        admin.create_tenant(svc.engine, "fuzz", actor="test")
        key, _ = admin.create_key(svc.engine, "fuzz", actor="test")
        f = svc.files.upload("fuzz", "batch", "seed.jsonl", io.BytesIO(jsonl("m", 2)))
        schema = from_wsgi("/openapi.json", app).include(path_regex=r"^/v1/(files|batches|usage)")
        checks = [
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_headers_conformance,
            response_schema_conformance,
            negative_data_rejection,
            ignored_auth,
        ]
        operations = [op.ok() for op in schema.get_all_operations()]
        assert len(operations) == 10
        for op in operations:

            @settings(
                max_examples=25,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy())
            def check(case: Any) -> None:
                if (
                    case.path_parameters
                    and "file_id" in case.path_parameters
                    and case.path_parameters["file_id"] == "seed"
                ):
                    case.path_parameters["file_id"] = f.id
                case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, checks=checks)

            check()
    finally:
        app.extensions["tokenfleet.tenancy"].close()
        close_app(app)


def test_cli_submit_wait_shows_progress_and_saves_the_output(
    env: Env, emulator: EmulatorServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenfleet.cli.main import main as cli_main

    srv = make_server("127.0.0.1", 0, env.app, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    r = runner(env, HttpExecutor(emulator.base_url))
    r.start()
    src = tmp_path / "work.jsonl"
    src.write_bytes(jsonl(env.model, 12))
    out = tmp_path / "out.jsonl"
    try:
        rc = cli_main(
            [
                "batch",
                "submit",
                str(src),
                "--wait",
                "--interval",
                "0.1",
                "--base-url",
                f"http://127.0.0.1:{srv.server_port}/v1",
                "--api-key",
                env.keys["alpha"],
                "--output",
                str(out),
            ]
        )
    finally:
        r.stop()
        srv.shutdown()
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "completed 12" in text and f"output: {out} (12 lines)" in text
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == sorted(
        f"req-{i}" for i in range(12)
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a"}\nnot json\n')
    rc = cli_main(
        ["batch", "submit", str(bad), "--base-url", "http://127.0.0.1:1/v1", "--api-key", "k"]
    )
    assert rc == 2 and "cannot reach the API" in capsys.readouterr().err


def test_an_idle_runner_keeps_house_at_the_idle_period_and_a_wake_runs_it_now(env: Env) -> None:
    """Housekeeping (four statements a round) runs every ``housekeeping_s`` while
    a batch is in progress or its last round found work, else every
    ``idle_housekeeping_s``; a batch created or cancelled here wakes it."""
    r = BatchRunner(
        env.svc.engine,
        env.svc.files,
        None,
        config=RunnerConfig(
            poll_s=0.01, idle_poll_s=0.01, housekeeping_s=0.01, idle_housekeeping_s=30.0
        ),
    )
    rounds: list[bool] = []
    keep = r.housekeeping

    def counted() -> bool:
        rounds.append(keep())
        return rounds[-1]

    r.housekeeping = counted  # type: ignore[method-assign]
    r._busy = False
    for _ in range(5):
        r.tick()
        time.sleep(0.02)
    assert rounds == [False]  # nothing to do, nothing in progress: next round in 30 s
    r.wake()
    r.tick()
    assert rounds == [False, False]
    r._busy = True  # a batch in progress (as the last release round saw it)
    r.wake()
    r.tick()  # ...so the next round is housekeeping_s away; this tick's release clears it
    time.sleep(0.02)
    r.tick()
    assert len(rounds) == 4
    for _ in range(3):
        time.sleep(0.02)
        r.tick()
    assert len(rounds) == 4


def test_an_idle_runner_polls_the_database_less_often(env: Env) -> None:
    """No batch in progress and no line running: poll at the housekeeping period
    (bounded by ``idle_poll_s``), not every ``poll_s``; busy again once a round
    sees a batch in progress."""
    r = BatchRunner(
        env.svc.engine,
        env.svc.files,
        None,
        config=RunnerConfig(poll_s=0.2, idle_poll_s=1.0, housekeeping_s=1.0),
    )
    assert r._poll_s() == 0.2  # until a round has looked
    r.release()
    assert r._poll_s() == 1.0
    assert RunnerConfig(poll_s=0.2, idle_poll_s=5.0, housekeeping_s=0.5).idle_poll_s == 5.0
    r.cfg = RunnerConfig(poll_s=0.2, idle_poll_s=5.0, housekeeping_s=0.5)
    assert r._poll_s() == 0.5
    r._busy = True
    assert r._poll_s() == 0.2
