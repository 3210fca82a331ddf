"""Operator experience (issue #18): the demo tenant and key of ``tokenfleet up``,
failing fast on a taken port, metrics, access logs, quiet control ticks,
``/v1/completions``, simulator output and the container files."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import sqlalchemy as sa

from tests.support.stores import fresh_database
from tokenfleet.service.db import make_engine
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis

ROOT = Path(__file__).resolve().parents[1]


# ---- the demo tenant and key ------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(pg: EmbeddedPostgres) -> Iterator[sa.Engine]:
    eng = make_engine(fresh_database(pg, "operator"), pool_size=2)
    yield eng
    eng.dispose()


def test_demo_key_belongs_to_a_real_tenant_and_survives_restarts(
    engine: sa.Engine, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    from tokenfleet.tenancy import admin
    from tokenfleet.tenancy.demo import DEMO_KEY_FILE, ensure_demo_key
    from tokenfleet.tenancy.directory import TenantDirectory

    client = redis_server.client()
    directory = TenantDirectory(engine, client, prefix="optest")
    first = ensure_demo_key(engine, tmp_path, cache=directory)
    assert first.tenant == "demo"
    saved = tmp_path / DEMO_KEY_FILE
    assert saved.read_text().strip() == first.key
    assert saved.stat().st_mode & 0o077 == 0, "the key file is private to its owner"
    # a restart (a second `up` on the same data dir) prints the same key, which still works
    again = ensure_demo_key(engine, tmp_path, cache=directory)
    assert again.key == first.key
    ctx = directory.authenticate(first.key)
    assert ctx is not None and ctx.id == "demo"
    # a real tenant: listed, with one key, and quotas apply to it
    listed = {t.id: n for t, n in admin.list_tenants(engine)}
    assert listed.get("demo") == 1
    admin.set_quota(engine, "demo", "interactive", {"requests_per_minute": 7}, actor="test")
    tenant = admin.get_tenant(engine, "demo")
    assert tenant is not None and tenant.quotas.interactive.requests_per_minute == 7
    # an operator revoked it: the next `up` does not revive it, it saves a new one
    assert admin.revoke_key(engine, first.key, actor="test", cache=directory) == 1
    fresh = ensure_demo_key(engine, tmp_path, cache=directory)
    assert fresh.key != first.key and "revoked" in fresh.note
    assert saved.read_text().strip() == fresh.key
    assert directory.authenticate(fresh.key) is not None
    assert directory.authenticate(first.key) is None
    # TOKENFLEET_API_KEY: registered for demo too, and not written to the data dir
    chosen = ensure_demo_key(engine, tmp_path, configured_key="tf-chosen-by-operator")
    assert chosen.key == "tf-chosen-by-operator" and chosen.tenant == "demo"
    assert saved.read_text().strip() == fresh.key
    client.close()


def _up_refused(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tokenfleet up ARGS`` run to its refusal (exit status 2: a usage error)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
    r = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli.main", "up", *args]
        + ["--data-dir", str(tmp_path / "tf")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr
    return r


def test_up_fails_at_once_with_the_reason_when_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _up_refused(tmp_path, "--port", str(port))
    assert f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr
    assert "--port" in r.stderr and "make up PORT=" in r.stderr
    assert not (tmp_path / "tf" / "run").exists(), "nothing was started"


def test_make_up_takes_a_port_and_shows_install_progress() -> None:
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\nup:", 1)[1].split("\n\n", 1)[0]
    assert "--port $(PORT)" in recipe
    setup = text.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    assert "--quiet" not in setup and "echo" in setup


# ---- the live API: /v1/completions, metrics, the access log -------------------------------
@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[Any]:
    from tests.support.stack import InstanceSpec

    with live_stack(
        router="tokenpilot",
        instances=[InstanceSpec("dc-a", "a0"), InstanceSpec("dc-b", "b0")],
        live_overrides={"worker_events": True},  # what `up --flower` and compose turn on
    ) as s:
        yield s


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_legacy_completions_string_token_ids_and_stream_with_usage(stack: Any) -> None:
    c = stack.client()
    r = c.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=6)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage is not None and 1 <= r.usage.completion_tokens <= 6
    assert r.usage.prompt_tokens == 4  # "Once upon a time": 16 bytes, 4 bytes a token
    # the emulator writes one word per token: the text is the whole answer
    assert len(r.choices[0].text.split()) == r.usage.completion_tokens
    dflt = c.completions.create(
        model=stack.model, prompt="no budget given", extra_body={"ignore_eos": True}
    )
    assert dflt.usage is not None and dflt.usage.completion_tokens == 16  # OpenAI's default
    ids = c.completions.create(model=stack.model, prompt=list(range(100, 140)), max_tokens=3)
    assert ids.usage is not None and ids.usage.prompt_tokens == 40
    chunks = list(
        c.completions.create(
            model=stack.model,
            prompt="stream me",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(ch.object == "text_completion" for ch in chunks)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert len(text.split()) == chunks[-1].usage.completion_tokens
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=stack.model, prompt=["two", "prompts"], max_tokens=2)
    assert exc.value.body["param"] == "prompt"  # type: ignore[index]
    # the same gateway path as chat: the ledger has the rows, with the tenant
    rid = r.id.removeprefix("cmpl-")
    rows = stack.ledger_rows(expect=lambda rows: rid in {row["request_id"] for row in rows})
    assert rid in {row["request_id"] for row in rows}


def test_metrics_count_rejections_auth_failures_and_slo_per_tenant_and_tier(
    stack: Any,
) -> None:
    from tests.support.stack import TENANT
    from tokenfleet.tenancy import admin

    eng = make_engine(stack.database_url, pool_size=1)
    try:
        admin.create_tenant(eng, "metered", actor="test")
        admin.set_quota(eng, "metered", "interactive", {"requests_per_minute": 1}, actor="test")
        key, _ = admin.create_key(eng, "metered", actor="test")
    finally:
        eng.dispose()
    before = requests.get(stack.url + "/metrics", timeout=5)
    assert before.headers["Content-Type"].count("charset") == 1
    ok = stack.client()
    ok.chat.completions.create(
        model=stack.model, max_tokens=2, messages=[{"role": "user", "content": "count me"}]
    )
    metered = _client(stack, key)
    metered.chat.completions.create(
        model=stack.model, max_tokens=2, messages=[{"role": "user", "content": "first"}]
    )
    with pytest.raises(openai.RateLimitError):
        metered.chat.completions.create(
            model=stack.model, max_tokens=2, messages=[{"role": "user", "content": "second"}]
        )
    with pytest.raises(openai.AuthenticationError):
        _client(stack, "tf-not-a-key-at-all").models.list()
    m = requests.get(stack.url + "/metrics", timeout=5).text
    rejected = _metric(m, "tokenfleet_rejections_total", tenant="metered", reason="quota")
    assert rejected == 1.0
    assert _metric(m, "tokenfleet_auth_failures_total") >= 1.0
    served = _metric(m, "tokenfleet_requests_total", tenant=TENANT, tier="interactive")
    assert served >= 1.0
    slo = sum(
        _metric(m, "tokenfleet_requests_total", tenant="metered", status=s)
        for s in ("completed", "slo_missed")
    )
    assert slo == 1.0, "the metered tenant's one served request, with its SLO verdict"
    # a healthy fleet without home DCs: no decision is a failover
    assert _metric(m, "tokenfleet_dc_decisions_total", reason="failover") == 0.0
    assert _metric(m, "tokenfleet_dc_decisions_total") >= 2.0


def _client(stack: Any, key: str) -> Any:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_access_log_has_one_line_per_request_with_its_fields(
    stack: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.support.stack import TENANT

    caplog.set_level(logging.INFO, logger="tokenfleet.access")
    c = stack.client()
    r = c.chat.completions.create(
        model=stack.model, max_tokens=3, messages=[{"role": "user", "content": "log me"}]
    )
    rid = r.id.removeprefix("chatcmpl-")
    list(
        c.chat.completions.create(
            model=stack.model,
            max_tokens=3,
            stream=True,
            messages=[{"role": "user", "content": "log my stream"}],
        )
    )
    requests.get(stack.url + "/health", timeout=5)

    def lines() -> list[logging.LogRecord]:
        return [x for x in caplog.records if x.name == "tokenfleet.access"]

    assert wait_until(lambda: len(lines()) >= 2)
    mine = [x for x in lines() if f"id={rid} " in x.getMessage()]
    assert len(mine) == 1, [x.getMessage() for x in lines()]
    f = mine[0].fields  # type: ignore[attr-defined]
    assert f["tenant"] == TENANT and f["tier"] == "interactive" and f["status"] == 200
    assert f["dc"] in ("dc-a", "dc-b") and f["instance"] in ("a0", "b0")
    assert f["outcome"] in ("completed", "slo_missed") and f["ttft_ms"] is not None
    assert f["completion_tokens"] == r.usage.completion_tokens  # type: ignore[union-attr]
    stream_line = [x for x in lines() if x is not mine[0]][0].fields  # type: ignore[attr-defined]
    assert stream_line["completion_tokens"] >= 1 and stream_line["outcome"] is not None
    assert not any("/health" in x.getMessage() for x in lines()), "scrapes are not logged"


def test_workers_send_heartbeats_and_task_events_for_flower(stack: Any) -> None:
    """Flower lists workers from their heartbeats and tasks from task events; both
    were off, so Flower showed 0 workers. A real event receiver on the broker."""
    import threading

    from celery import Celery

    seen: dict[str, set[str]] = {"hosts": set(), "tasks": set()}
    app = Celery(broker=stack.broker_url or stack.redis.url, set_as_current=False)

    def on_event(ev: dict[str, Any]) -> None:
        if ev.get("type") == "worker-heartbeat":
            seen["hosts"].add(ev["hostname"])
        elif ev.get("type", "").startswith("task-"):
            seen["tasks"].add(ev["type"])

    stop = threading.Event()

    def listen() -> None:
        with app.connection_for_read() as conn:
            recv = app.events.Receiver(conn, handlers={"*": on_event})
            while not stop.is_set():
                try:  # returns only by raising: a timeout when idle, then stop is checked
                    recv.capture(limit=None, timeout=0.5, wakeup=False)
                except OSError:  # socket.timeout, or the broker gone at teardown
                    continue

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    try:
        c = stack.client()
        assert wait_until(lambda: len(seen["hosts"]) >= 2, 15.0)
        # a batch request: its tier's share (0.5 of the slots) is the workers'
        # gate to apply, so it is a Celery task even on an idle instance (an
        # interactive one there is run by the API itself: express dispatch)
        c.chat.completions.create(
            model=stack.model,
            max_tokens=2,
            messages=[{"role": "user", "content": "flower"}],
            extra_headers={"X-TokenFleet-Tier": "batch"},
        )
        assert wait_until(lambda: "task-succeeded" in seen["tasks"], 15.0)
    finally:
        stop.set()
        t.join(10)
    assert {h.split("@")[0] for h in seen["hosts"]} >= {"a0", "b0"}
    assert {"task-received", "task-started"} <= seen["tasks"]


def test_up_with_flower_but_without_the_extra_says_how_to_install_it(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("flower") is not None:
        pytest.skip("flower is installed here; this checks the message when it is not")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
    r = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli.main", "up", "--flower"]
        + ["--port", "0", "--data-dir", str(tmp_path / "tf")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "tokenfleet[flower]" in r.stderr, r.stderr


def wait_until(cond: Any, timeout_s: float = 10.0) -> bool:
    """Poll ``cond`` (a log line is written when the response closes, just after
    the client has it); a bounded wait, not a timing assertion."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


# ---- logs: quiet control ticks, JSON ------------------------------------------------------
def test_control_ticks_log_at_info_only_when_something_changes(
    redis_server: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    from tokenfleet.live.config import LiveConfig
    from tokenfleet.live.state import LiveState
    from workers import control

    state = LiveState.from_url(redis_server.url, prefix="quiet")
    saved = control.CONTEXT
    control.CONTEXT = control.ControlContext(live=LiveConfig.load(), state=state)
    caplog.set_level(logging.DEBUG, logger=control.log.name)
    try:
        for _ in range(4):  # an idle fleet: the controller holds every time
            control.control_tick()
        # interactive misses its SLO: the controller acts, and says so
        for _ in range(3):
            state.count(arrived_interactive=40, finished_interactive=40, slo_met_interactive=5)
            control.control_tick()
    finally:
        control.CONTEXT = saved
    ticks = [r for r in caplog.records if r.getMessage().startswith("SLOMax tick")]
    assert len(ticks) == 7
    info = [r for r in ticks if r.levelno == logging.INFO]
    assert ticks[0].levelno == logging.INFO, "the first tick says where the knobs start"
    assert all(r.levelno == logging.DEBUG for r in ticks[1:4]), "holding ticks are quiet"
    assert len(info) >= 2 and any(r in info for r in ticks[4:]), "a change is logged"


def test_json_log_format_puts_access_fields_at_the_top_level() -> None:
    import json

    from tokenfleet.cli.logs import JsonFormatter, log_format

    rec = logging.LogRecord("tokenfleet.access", logging.INFO, __file__, 1, "x", None, None)
    rec.fields = {"id": "r1", "tenant": "demo", "status": 200, "ttft_ms": 12.5}
    obj = json.loads(JsonFormatter().format(rec))
    assert obj["tenant"] == "demo" and obj["status"] == 200 and obj["level"] == "INFO"
    assert log_format("JSON") == "json"
    with pytest.raises(ValueError, match="text, json"):
        log_format("xml")


# ---- simulator output ---------------------------------------------------------------------
def _records(n: int, ttft_s: float, seed: int) -> list[Any]:
    from tokenfleet.sim.records import RequestRecord

    out = []
    for i in range(n):
        r = RequestRecord(f"{seed}-{i}", "t", "interactive", float(i), 100, 20)
        r.first_token_s = r.arrival_s + ttft_s * (1 + i % 3)
        r.finish_s = r.first_token_s + 1.0
        r.output_tokens = 20
        r.status = "completed"
        r.slo_met = ttft_s * (1 + i % 3) <= 1.0
        out.append(r)
    return out


def test_sim_plots_keep_titles_inside_and_show_goodput_and_the_slo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenfleet.sim import plots

    figs: dict[str, Any] = {}
    real_save = plots._save

    def keep(fig: Any, path: Path) -> Path:
        fig.canvas.draw()
        figs[path.name] = (fig, fig.get_window_extent(), fig._suptitle.get_window_extent())
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    runs = {"sglang_cache_aware": _records(30, 0.4, 1), "tokenpilot": _records(30, 0.2, 2)}
    long_title = "synthetic:mixed | 8 x llama3-8b-h200 | load 0.8 | scrape 100 ms | " * 3
    paths = plots.plot_runs(
        runs, tmp_path, long_title, goodput_tok_s={"sglang_cache_aware": 5.0, "tokenpilot": 9.0}
    )
    assert {p.name for p in paths} == {"ttft_cdf.png", "over_time.png", "goodput.png"}
    for name, (_fig, canvas, title) in figs.items():
        assert canvas.x0 <= title.x0 and title.x1 <= canvas.x1, f"{name}: title clipped"
    cdf = figs["ttft_cdf.png"][0].axes[0]
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in cdf.lines), "SLO line at 1 s"
    over = figs["over_time.png"][0]
    assert "Goodput" in over._suptitle.get_text()
    assert [t.get_text() for t in over.axes[0].get_legend().get_texts()] == list(runs)
    bars = figs["goodput.png"][0].axes[0].patches
    assert [b.get_height() for b in bars] == [5.0, 9.0]


def test_sim_table_never_truncates_a_policy_name_at_100_columns() -> None:
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from tokenfleet.cli.commands.sim import _print_table

    summary = {
        "completed": 12000,
        "requests": 12000,
        "ttft_p50_s": 0.123,
        "ttft_p95_s": 2.5,
        "ttft_p99_s": 12.25,
        "tpot_p50_s": 0.0123,
        "throughput_tok_s": 12345.0,
        "goodput_tok_s": 12000.0,
        "slo_attainment": 1.0,
        "prefix_hit_ratio": 0.5,
        "utilization": 0.93,
    }
    names = ["round_robin", "llmd_weighted", "sglang_cache_aware", "tokenpilot", "dynamo_kv"]
    runs = [SimpleNamespace(policy=n, label=n, summary=summary, wall_s=12.5) for n in names]
    buf = io.StringIO()
    console = Console(width=100, file=buf, color_system=None)
    _print_table(runs, "synthetic:mixed | 8 x llama3-8b-h200 | load 0.8", console)
    text = buf.getvalue()
    for n in names:
        assert n in text, text
    assert "…" not in text and "..." not in text
    assert "12000/12000" in text and "12345" in text and "100.0%" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_sim_policy_help_lists_every_router() -> None:
    from tokenfleet.cli.commands.sim import ROUTER_NAMES
    from tokenfleet.core.routing import ROUTERS

    assert sorted(ROUTER_NAMES) == sorted(ROUTERS.names())
    r = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli.main", "sim", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )
    helptext = " ".join(r.stdout.split())
    for name in ROUTER_NAMES:
        assert name in helptext


# ---- container files (no Docker daemon needed) ---------------------------------------------
def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), " ".join(rest.split())))
    return out


def test_dockerfile_user_owns_the_data_dir_the_volume_mounts() -> None:
    import yaml

    steps = _dockerfile()
    users = [i for i, (op, _) in enumerate(steps) if op == "USER"]
    assert users, "the image runs as an unprivileged user"
    user = steps[users[-1]][1]
    env = {
        k: v
        for op, rest in steps
        if op == "ENV"
        for k, v in [rest.split("=", 1) if "=" in rest else rest.split(" ", 1)]
    }
    data_dir = env["TOKENFLEET_DATA_DIR"]
    before_user = " && ".join(rest for op, rest in steps[: users[-1]] if op == "RUN")
    # created, and owned by the runtime user, before the image switches to it
    assert f"mkdir -p {data_dir}" in before_user
    assert f"chown -R {user}:{user} {data_dir}" in before_user
    assert "useradd" in before_user and user in before_user
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    base = compose["x-tokenfleet"]
    assert f"tokenfleet-data:{data_dir}" in base["volumes"]
    assert compose["x-tokenfleet-env"]["TOKENFLEET_DATA_DIR"] == data_dir


def test_compose_explains_keys_and_logins_and_flower_needs_auth() -> None:
    import yaml

    text = (ROOT / "docker-compose.yml").read_text()
    header = text.split("x-tokenfleet-env", 1)[0]
    assert "tokenfleet tenants demo" in header and "admin-user" in header
    assert "Authorization: Bearer" in header
    flower = yaml.safe_load(text)["services"]["flower"]
    script = " ".join(flower["command"])
    assert 'test -n "$$FLOWER_BASIC_AUTH"' in script and "exit" in script
    assert flower["environment"]["FLOWER_UNAUTHENTICATED_API"] == "false"
    assert all(p.startswith("127.0.0.1:") for p in flower["ports"]), "loopback only"
    assert "TOKENFLEET_WORKER_EVENTS" in yaml.safe_load(text)["x-tokenfleet-env"]


def test_docker_compose_config_is_valid() -> None:
    import shutil

    # Compose v2 (the docker CLI plugin), else the standalone v1 `docker-compose`
    docker = shutil.which("docker")
    compose: list[str] = []
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            compose = [docker, "compose"]
    if not compose and shutil.which("docker-compose"):
        compose = [str(shutil.which("docker-compose"))]
    if not compose:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed here")
    for profile in ([], ["--profile", "monitoring"]):
        r = subprocess.run(
            [*compose, *profile, "config", "--quiet"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr


def test_tenants_demo_cli_prints_the_same_key_every_time(
    engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenfleet.cli.main import main as cli_main

    url = engine.url.render_as_string(hide_password=False)
    args = ["tenants", "demo", "--quiet", "--database-url", url, "--data-dir", str(tmp_path)]
    assert cli_main(args) == 0
    first = capsys.readouterr().out.strip()
    assert cli_main(args) == 0
    assert capsys.readouterr().out.strip() == first and first.startswith("tf-demo-")


# ---- admin charts (server-side SVG) ----------------------------------------------------
def test_chart_ticks_are_round_numbers_and_labels_stay_inside() -> None:
    import re

    from web.admin.charts import line_chart, nice_ticks

    assert nice_ticks(4.6) == [0.0, 2.0, 4.0, 6.0]
    assert nice_ticks(4.0) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert nice_ticks(3100.0) == [0.0, 1000.0, 2000.0, 3000.0, 4000.0]
    assert nice_ticks(0.37) == [0.0, 0.1, 0.2, 0.3, 0.4]
    for v in (0.9, 3.7, 5.0, 12.0, 77.0, 950.0, 12345.0):
        ticks = nice_ticks(v)
        step = ticks[1]
        mantissa = step / 10 ** int(f"{step:e}".split("e")[1])
        assert round(mantissa, 6) in (1.0, 2.0, 5.0), (v, ticks)
        assert ticks[-1] >= v and len(ticks) <= 6
    t0 = 1_796_000_000.0
    series = {
        "batch": [(t0, 1.0), (t0 + 600, 2.0)],
        "interactive": [(t0, 3.0), (t0 + 600, 4.6)],
        "long_context": [(t0, 0.5), (t0 + 600, 0.7)],
    }
    svg = str(line_chart(series, title="goodput", chart_id="c"))
    labels = re.findall(
        r'<text x="([\d.]+)" y="[\d.]+" text-anchor="(\w+)" class="tick">(\d\d:\d\d)', svg
    )
    assert [a for _, a, _ in labels] == ["start", "middle", "end"], "last label ends at the edge"
    ticks = re.findall(r'class="tick ytick">([\d.k]+)</text>', svg)
    assert ticks == ["0", "2", "4", "6"]
    legend = re.findall(r'class="legend">(\w+)</text>', svg)
    assert legend == ["interactive", "long_context", "batch"], "tiers in priority order"
    reordered = dict(reversed(list(series.items())))
    legend2 = re.findall(r'class="legend">(\w+)</text>', str(line_chart(reordered, title="x")))
    assert legend2 == legend
    assert 'width="460"' not in svg.split(">", 1)[0], "the SVG scales to its container"
    short = str(line_chart({"batch": [(t0, 1.0), (t0 + 60, 2.0)]}, title="a minute"))
    times = re.findall(r'class="tick">(\d\d:\d\d:\d\d)</text>', short)
    assert len(times) == 3 and len(set(times)) == 3, "a short span still has distinct labels"
    idle = str(line_chart({"batch": [(t0, 0.0), (t0 + 60, 0.0)]}, title="idle"))
    assert re.findall(r'class="tick ytick">([\d.k]+)</text>', idle) == ["0", "1", "2", "3", "4"]


# ---- API keys: expiry and last use ---------------------------------------------------------
def test_keys_expire_are_never_cached_past_expiry_and_record_their_last_use(
    engine: sa.Engine, redis_server: EmbeddedRedis
) -> None:
    from datetime import UTC, datetime, timedelta

    from tokenfleet.service.ledger import ApiKey, hash_api_key
    from tokenfleet.tenancy import admin
    from tokenfleet.tenancy.directory import TenantDirectory

    client = redis_server.client()
    d = TenantDirectory(engine, client, prefix="expiry")
    admin.create_tenant(engine, "keyed", actor="test")
    with pytest.raises(Exception, match="future"):
        admin.create_key(engine, "keyed", actor="t", expires_at=datetime.now(UTC))
    soon, _ = admin.create_key(
        engine, "keyed", actor="t", expires_at=datetime.now(UTC) + timedelta(seconds=30)
    )
    forever, _ = admin.create_key(engine, "keyed", actor="t")
    assert d.authenticate(soon) is not None and d.authenticate(forever) is not None
    ttl_ms = client.pttl(f"expiry:apikey2:{hash_api_key(soon)}")
    assert 0 < ttl_ms <= 30_000, "the cached entry lapses with the key"
    # the key's expiry passes (set in the past here rather than waiting for it)
    with engine.begin() as conn:
        conn.execute(
            sa.update(ApiKey)
            .where(ApiKey.key_sha256 == hash_api_key(soon))
            .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    d.forget_keys([hash_api_key(soon)])
    assert d.authenticate(soon) is None and d.authenticate(forever) is not None
    # last use: written by a flush (every minute, off the request path)
    assert d.flush_last_used() == 2
    keys = {k.prefix: k for k in admin.list_keys(engine, "keyed")}
    used = keys[forever[:10]]
    assert used.last_used_at is not None and used.expires_at is None
    assert keys[soon[:10]].expires_at is not None
    assert d.flush_last_used() == 0, "nothing new to write"
    client.close()


def test_a_key_with_its_own_limit_is_capped_alone(stack: Any) -> None:
    from tokenfleet.tenancy import admin

    eng = make_engine(stack.database_url, pool_size=1)
    try:
        admin.create_tenant(eng, "perkey", actor="test")
        capped, info = admin.create_key(eng, "perkey", actor="test", requests_per_minute=1)
        free, _ = admin.create_key(eng, "perkey", actor="test")
        listed = {k.id: k for k in admin.list_keys(eng, "perkey")}
    finally:
        eng.dispose()
    assert listed[info.id].requests_per_minute == 1
    msgs = [{"role": "user", "content": "per key"}]
    _client(stack, capped).chat.completions.create(model=stack.model, messages=msgs, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as exc:
        _client(stack, capped).chat.completions.create(
            model=stack.model, messages=msgs, max_tokens=2
        )
    assert f"API key {info.id} of tenant 'perkey'" in str(exc.value)
    assert exc.value.response.headers.get("Retry-After")
    for _ in range(2):  # the tenant's other key is not capped by it
        _client(stack, free).chat.completions.create(model=stack.model, messages=msgs, max_tokens=2)


def test_cli_creates_expiring_keys_with_their_own_limits(
    engine: sa.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenfleet.cli.main import main as cli_main
    from tokenfleet.tenancy import admin

    admin.create_tenant(engine, "clikeys", actor="test")
    url = engine.url.render_as_string(hide_password=False)
    common = ["--database-url", url, "--data-dir", str(tmp_path)]
    create = ["tenants", "keys", "create", "clikeys", "-q", "--expires-days", "2", "--rpm", "5"]
    assert cli_main(create + common) == 0
    key = capsys.readouterr().out.strip()
    assert cli_main(["tenants", "keys", "list", "clikeys", *common]) == 0
    out = capsys.readouterr().out
    assert key[:10] in out and "rpm=5" in out and "never" not in out and "active" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--instances-per-dc", "2", "--prefill-per-dc", "1"], "tokenpilot_pd"),
        (["--prefill-per-dc", "1", "--router", "tokenpilot_pd"], "--instances-per-dc"),
    ],
    ids=["not-a-pd-router", "no-decode-engine-left"],
)
def test_up_refuses_a_pd_split_it_cannot_serve(tmp_path: Path, args: list[str], says: str) -> None:
    r = _up_refused(tmp_path, "--port", "0", *args)
    assert "--prefill-per-dc" in r.stderr and says in r.stderr, r.stderr
    assert not (tmp_path / "tf" / "run").exists(), "nothing was started"
