"""``tokenfleet up`` on a fresh data dir: everything starts, serves the openai
client, records the ledger, and SIGTERM leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.stores import temp_data_dir
from tokenfleet.service.embedded import free_port

KEY = "tf-up-test-key"

pytestmark = pytest.mark.stack  # `tokenfleet up` as a subprocess: the whole stack


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def up() -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    with temp_data_dir("tokenfleet-up-") as data_dir:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
        env["TOKENFLEET_API_KEY"] = KEY
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenfleet.cli.main",
                "up",
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
                "--time-scale",
                "0.05",
                "--loglevel",
                "WARNING",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd="/",
        )  # from anywhere: nothing may depend on the working directory
        out: list[str] = []
        deadline = time.monotonic() + 120
        try:
            assert proc.stdout is not None
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                out.append(line)
                if "Press Ctrl-C to stop" in line:
                    break
            text = "".join(out)
            assert "TokenFleet is up." in text, text
            yield proc, text, data_dir
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    for pid in _descendants(proc.pid):
                        os.kill(pid, signal.SIGKILL)
                    proc.kill()


def test_up_prints_url_key_and_examples(up: tuple[subprocess.Popen[str], str, Path]) -> None:
    _, text, _ = up
    assert KEY in text, "TOKENFLEET_API_KEY is used as the demo key"
    assert "curl http://127.0.0.1:" in text and "/v1/chat/completions" in text
    assert "from openai import OpenAI" in text
    # the key is a real key of the real tenant `demo`; the banner says how to log in to /admin
    assert 'tenant "demo"' in text and "tenants set-quota demo" in text
    assert "/admin" in text and "admin-user" in text


def test_up_serves_the_openai_client_and_records_the_ledger(
    up: tuple[subprocess.Popen[str], str, Path],
) -> None:
    proc, text, data_dir = up
    url = text.split("API:", 1)[1].split()[0]
    c = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
    model = c.models.list().data[0].id
    r = c.chat.completions.create(
        model=model, max_tokens=5, messages=[{"role": "user", "content": "hello up"}]
    )
    assert r.usage is not None and r.usage.completion_tokens >= 1
    chunks = list(
        c.chat.completions.create(
            model=model,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "stream"}],
        )
    )
    assert chunks[-1].usage is not None
    # the ledger lives in the embedded PostgreSQL under the data dir
    import sqlalchemy as sa

    from tokenfleet.service.db import make_engine

    pg = json.loads((data_dir / "run" / "postgres.json").read_text())
    engine = make_engine(pg["url"])
    try:
        deadline = time.monotonic() + 10
        while True:
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text("SELECT request_id, status, dc FROM requests WHERE tenant_id = 'demo'")
                ).all()
            done = [row for row in rows if row.status in ("completed", "slo_missed")]
            if len(done) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        engine.dispose()
    assert r.id.removeprefix("chatcmpl-") in {row.request_id for row in done}
    assert {row.dc for row in done} <= {"dc-east", "dc-west"}


def _server_state(data_dir: Path, name: str) -> dict[str, object]:
    try:
        return dict(json.loads((data_dir / "run" / f"{name}.json").read_text()))
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
def test_up_restarts_killed_embedded_stores_and_serves_again(
    up: tuple[subprocess.Popen[str], str, Path],
) -> None:
    """kill -9 of the embedded Redis, then of PostgreSQL: `up` starts each again
    on the same port and data dir, and the API, workers and beat reconnect (a
    chat request is served, and recorded, without restarting anything else)."""
    proc, text, data_dir = up
    url = text.split("API:", 1)[1].split()[0]
    c = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
    model = c.models.list().data[0].id
    import sqlalchemy as sa

    from tokenfleet.service.db import make_engine

    for name in ("redis", "postgres"):
        before = _server_state(data_dir, name)
        assert before and _alive(int(str(before["pid"]))), before
        os.kill(int(str(before["pid"])), signal.SIGKILL)
        deadline = time.monotonic() + 90
        after: dict[str, object] = {}
        while time.monotonic() < deadline:
            after = _server_state(data_dir, name)
            if after and after["pid"] != before["pid"] and _alive(int(str(after["pid"]))):
                break
            time.sleep(0.2)
        assert after.get("pid") != before["pid"], f"{name} was not restarted"
        assert after["port"] == before["port"], "clients keep the URL they have"
        served = None
        while time.monotonic() < deadline:
            try:
                served = c.chat.completions.create(
                    model=model, max_tokens=3, messages=[{"role": "user", "content": name}]
                )
                break
            except openai.APIError:
                time.sleep(0.5)
        assert served is not None, f"not serving again after the {name} restart"
        rid = served.id.removeprefix("chatcmpl-")
        engine = make_engine(
            str(after["url"])
            if name == "postgres"
            else str(_server_state(data_dir, "postgres")["url"])
        )
        try:
            row = None
            while time.monotonic() < deadline and row is None:
                with engine.connect() as conn:
                    row = conn.execute(
                        sa.text("SELECT status FROM requests WHERE request_id = :r"), {"r": rid}
                    ).first()
                if row is None or row.status == "in_flight":
                    row = None
                    time.sleep(0.3)
        finally:
            engine.dispose()
        assert row is not None and row.status in ("completed", "slo_missed"), row
    assert proc.poll() is None, "up itself kept running"


def test_sigterm_stops_everything(up: tuple[subprocess.Popen[str], str, Path]) -> None:
    proc, _, _ = up
    kids = _descendants(proc.pid)
    assert len(kids) >= 8, "redis, postgres, 2 engines, 2 workers, beat, api"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    time.sleep(0.5)
    left = [p for p in kids if _alive(p)]
    assert not left, f"processes left behind: {left}"
