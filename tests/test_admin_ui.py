"""The admin web UI: login, CSRF, audit (Flask test client), then real Chromium.

The Playwright part drives Debian's ``/usr/bin/chromium`` against a full live
stack (embedded Redis + PostgreSQL, emulated engines, Celery workers, the
API): log in, create a tenant, set a quota, see the API enforce it, submit a
batch and watch its progress bar fill. Screenshots are saved under
``out/test-artifacts/playwright/`` (or ``$TOKENFLEET_ARTIFACTS_DIR``).

When Chromium or the ``playwright`` package is missing, the test installs
them (``apt-get install chromium`` as root, ``pip install playwright``); it
skips, saying why, only when that is impossible.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient

from tests.support.stores import embedded_redis, fresh_database, temp_data_dir
from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis
from tokenfleet.tenancy import admin as tenants
from web.admin import init_app as init_admin
from web.admin.auth import set_admin_password
from web.batch_api import init_app, start_runner

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = (
    Path(os.environ.get("TOKENFLEET_ARTIFACTS_DIR") or REPO / "out" / "test-artifacts")
    / "playwright"
)
CHROMIUM = "/usr/bin/chromium"
PASSWORD = "correct-horse-battery"


# ---- server-side behaviour (no browser) -------------------------------------------------
@pytest.fixture(scope="module")
def stores(pg: EmbeddedPostgres) -> Iterator[tuple[Path, EmbeddedRedis, EmbeddedPostgres]]:
    with temp_data_dir() as d, embedded_redis(d) as r:
        yield d, r, pg


@pytest.fixture
def app(stores: tuple[Path, EmbeddedRedis, EmbeddedPostgres]) -> Iterator[Flask]:
    d, r, pg = stores
    name = f"adm{time.monotonic_ns()}"
    url = fresh_database(pg, name)
    flask_app = Flask(name)
    init_app(
        flask_app, DATABASE_URL=url, REDIS_URL=r.url, DATA_DIR=str(d / name), REDIS_PREFIX=name
    )
    init_admin(flask_app)
    svc = flask_app.extensions["tokenfleet.tenancy"]
    set_admin_password(svc.engine, "root", PASSWORD, actor="test")
    yield flask_app
    svc.close()
    svc.engine.dispose()
    pg.drop_database(name)  # the session's server: keep its disk small


def csrf(client: FlaskClient, path: str = "/admin/login") -> str:
    page = client.get(path).data.decode()
    m = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert m, page[:500]
    return m.group(1)


def login(client: FlaskClient) -> str:
    tok = csrf(client)
    r = client.post(
        "/admin/login", data={"username": "root", "password": PASSWORD, "csrf_token": tok}
    )
    assert r.status_code == 302, r.data[:300]
    return csrf(client, "/admin/tenants")


def audit_actions(app: Flask) -> list[tuple[str, str]]:
    rows = tenants.audit_log(app.extensions["tokenfleet.tenancy"].engine, limit=1000)
    return [(r["actor"], r["action"]) for r in reversed(rows)]


def test_pages_need_an_admin_login_not_an_api_key(app: Flask) -> None:
    c = app.test_client()
    for path in ("/admin/", "/admin/tenants", "/admin/batches", "/admin/audit", "/admin/live"):
        r = c.get(path)
        assert r.status_code == 302 and "/admin/login" in r.location
    svc = app.extensions["tokenfleet.tenancy"]
    tenants.create_tenant(svc.engine, "t1", actor="test")
    key, _ = tenants.create_key(svc.engine, "t1", actor="test")
    r = c.get("/admin/tenants", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 302, "a tenant API key must not open the admin UI"
    tok = csrf(c)
    bad = c.post(
        "/admin/login", data={"username": "root", "password": "nope-nope", "csrf_token": tok}
    )
    assert bad.status_code == 401 and b"wrong user name or password" in bad.data
    login(c)
    r = c.get("/admin/")
    assert r.status_code == 200 and b"goodput per tier" in r.data
    assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    assert r.headers["X-Frame-Options"] == "DENY"
    # nothing loaded from elsewhere (no CDN): every link and source is this site's
    # (not a substring search: the page carries random tokens, "cdn" among them
    # once in a few hundred renders)
    refs = re.findall(rb'(?:src|href|action)\s*=\s*["\']([^"\']*)', r.data)
    assert refs and not [u for u in refs if u.startswith((b"http:", b"https:", b"//"))]
    assert b"https://" not in r.data


def test_every_form_post_needs_the_csrf_token(app: Flask) -> None:
    c = app.test_client()
    assert (
        c.post("/admin/login", data={"username": "root", "password": PASSWORD}).status_code == 400
    )
    tok = login(c)
    for path, form in [
        ("/admin/tenants", {"tenant_id": "evil"}),
        ("/admin/tenants/x/quota/interactive", {"requests_per_minute": "1"}),
        ("/admin/logout", {}),
    ]:
        r = c.post(path, data=form)
        assert r.status_code == 400 and b"CSRF" in r.data, path
        r = c.post(path, data={**form, "csrf_token": tok + "x"})
        assert r.status_code == 400, path
    svc = app.extensions["tokenfleet.tenancy"]
    assert tenants.get_tenant(svc.engine, "evil") is None


def test_mutations_are_audited_and_keys_shown_once(app: Flask) -> None:
    c = app.test_client()
    tok = login(c)
    r = c.post(
        "/admin/tenants",
        data={
            "tenant_id": "acme",
            "slo_class": "premium",
            "allowed_regions": "eu-west, eu-central",
            "csrf_token": tok,
        },
    )
    assert r.status_code == 302
    c.post(
        "/admin/tenants/acme/quota/batch",
        data={
            "requests_per_minute": "100",
            "tokens_per_minute": "",
            "max_concurrent_requests": "4",
            "daily_token_budget": "1000000",
            "csrf_token": tok,
        },
    )
    r = c.post(
        "/admin/tenants/acme/quota/batch",
        data={"requests_per_minute": "lots", "csrf_token": tok},
        follow_redirects=True,
    )
    assert b"not a whole number" in r.data
    c.post("/admin/tenants/acme/keys", data={"name": "ci", "csrf_token": tok})
    page = c.get("/admin/tenants/acme").data.decode()
    key = re.search(r'id="new-key">([^<]+)<', page)
    assert key and key.group(1).startswith("tf-")
    assert key.group(1) not in c.get("/admin/tenants/acme").data.decode(), "key shown twice"
    svc = app.extensions["tokenfleet.tenancy"]
    ctx = svc.directory.authenticate(key.group(1))
    assert ctx is not None and ctx.allowed_regions == ("eu-west", "eu-central")
    assert ctx.quotas.batch.as_dict() == {
        "requests_per_minute": 100,
        "tokens_per_minute": None,
        "max_concurrent_requests": 4,
        "daily_token_budget": 1_000_000,
    }
    key_id = tenants.list_keys(svc.engine, "acme")[0].id
    c.post(f"/admin/tenants/acme/keys/{key_id}/revoke", data={"csrf_token": tok})
    time.sleep(svc.directory.local_ttl_s + 0.05)
    assert svc.directory.authenticate(key.group(1)) is None
    c.post("/admin/logout", data={"csrf_token": tok})
    acts = [a for a in audit_actions(app) if a[0] == "admin:root"]
    assert [a[1] for a in acts] == [
        "admin.login",
        "tenant.create",
        "tenant.set_quota",
        "key.create",
        "key.revoke",
        "admin.logout",
    ]
    audit_page = None
    tok = login(c)
    audit_page = c.get("/admin/audit").data.decode()
    assert "tenant.set_quota" in audit_page and key.group(1) not in audit_page


def test_password_change_ends_sessions_and_logins_are_rate_limited(app: Flask) -> None:
    c = app.test_client()
    login(c)
    assert c.get("/admin/tenants").status_code == 200
    svc = app.extensions["tokenfleet.tenancy"]
    set_admin_password(svc.engine, "root", "another-password", actor="test")
    assert c.get("/admin/tenants").status_code == 302
    attacker = app.test_client()
    tok = csrf(attacker)
    codes = [
        attacker.post(
            "/admin/login", data={"username": "root", "password": f"guess{i}", "csrf_token": tok}
        ).status_code
        for i in range(12)
    ]
    # five free tries, then the back-off refuses without checking the password
    assert codes == [401] * 5 + [429] * 7
    r = attacker.post(
        "/admin/login", data={"username": "root", "password": "another-password", "csrf_token": tok}
    )
    assert r.status_code == 429 and b"too many failed logins" in r.data
    assert int(r.headers["Retry-After"]) >= 1


def _set_cookie(resp: Any) -> str:
    cookies = [v for k, v in resp.headers.items() if k == "Set-Cookie" and "session=" in v]
    assert len(cookies) == 1, resp.headers
    return cookies[0]


def _login_response(client: FlaskClient, **kwargs: Any) -> Any:
    tok = csrf(client)
    r = client.post(
        "/admin/login",
        data={"username": "root", "password": PASSWORD, "csrf_token": tok},
        **kwargs,
    )
    assert r.status_code == 302, r.data[:300]
    return r


def test_session_cookie_is_httponly_lax_12h_and_secure_over_https(app: Flask) -> None:
    from email.utils import parsedate_to_datetime

    plain = _set_cookie(_login_response(app.test_client()))
    attrs = {a.strip().split("=")[0].lower(): a.strip() for a in plain.split(";")}
    assert "httponly" in attrs and attrs["samesite"] == "SameSite=Lax"
    assert "secure" not in attrs, "plain http: a Secure cookie would never come back"
    expires = parsedate_to_datetime(attrs["expires"].split("=", 1)[1])
    lifetime_h = (expires - datetime.now(UTC)).total_seconds() / 3600
    assert 11.9 < lifetime_h <= 12.0, lifetime_h  # Flask's own default is 31 days
    proxied = _login_response(app.test_client(), headers={"X-Forwarded-Proto": "https"})
    assert "; Secure" in _set_cookie(proxied)
    direct = _login_response(app.test_client(), base_url="https://localhost")
    assert "; Secure" in _set_cookie(direct)


def test_a_cookie_replayed_after_logout_is_refused(app: Flask) -> None:
    c = app.test_client()
    tok = login(c)
    stolen = c.get_cookie("session")
    assert stolen is not None
    assert c.post("/admin/logout", data={"csrf_token": tok}).status_code == 302
    replay = app.test_client()
    replay.set_cookie("session", stolen.value)
    r = replay.get("/admin/tenants")
    assert r.status_code == 302 and "/admin/login" in r.location
    # another, still logged-in session is not affected
    other = app.test_client()
    login(other)
    assert other.get("/admin/tenants").status_code == 200


def test_failed_logins_are_audited_and_shown_in_the_audit_log(app: Flask) -> None:
    c = app.test_client()
    c.environ_base["REMOTE_ADDR"] = "10.1.2.3"
    tok = csrf(c)
    r = c.post(
        "/admin/login", data={"username": "root", "password": "wrong-one", "csrf_token": tok}
    )
    assert r.status_code == 401
    assert ("anonymous@10.1.2.3", "admin.login_failed") in audit_actions(app)
    rows = tenants.audit_log(app.extensions["tokenfleet.tenancy"].engine, limit=10)
    failed = next(r for r in rows if r["action"] == "admin.login_failed")
    assert failed["payload"]["username"] == "root" and failed["payload"]["addr"] == "10.1.2.3"
    assert "wrong-one" not in json.dumps(failed["payload"])
    login(c)
    page = c.get("/admin/audit").data.decode()
    assert "admin.login_failed" in page and "anonymous@10.1.2.3" in page


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _try(client: FlaskClient, password: str, user: str = "root") -> Any:
    tok = csrf(client)
    return client.post(
        "/admin/login", data={"username": user, "password": password, "csrf_token": tok}
    )


def test_login_backoff_doubles_per_account_and_address_and_spares_other_addresses(
    app: Flask,
) -> None:
    from web.admin.auth import Backoff, LoginThrottle

    svc = app.extensions["tokenfleet.tenancy"]
    clock = _Clock()
    # lower thresholds than the defaults (5 and 20) keep the scrypt checks few
    app.extensions["tokenfleet.admin.throttle"] = LoginThrottle(
        svc.redis, svc.directory.prefix, pair=Backoff(free=2), address=Backoff(free=6), clock=clock
    )
    noisy = app.test_client()
    noisy.environ_base["REMOTE_ADDR"] = "10.0.0.66"
    assert [_try(noisy, f"guess{i}").status_code for i in range(2)] == [401] * 2
    waits = []
    for _ in range(3):
        r = _try(noisy, "still-wrong")
        assert r.status_code == 429, r.data[:200]
        waits.append(int(r.headers["Retry-After"]))
        clock.now += waits[-1]  # wait exactly the back-off, then fail once more
        assert _try(noisy, "still-wrong").status_code == 401
    assert waits == [1, 2, 4], waits  # exponential, not a fixed window
    # the admin behind another address logs in at once
    admin = app.test_client()
    admin.environ_base["REMOTE_ADDR"] = "10.0.0.7"
    assert _try(admin, PASSWORD).status_code == 302
    # the noisy address (5 failures so far) is slowed down for every account it tries
    clock.now += 10_000
    assert _try(noisy, "x", user="user0").status_code == 401
    r = _try(noisy, "x", user="user-new")
    assert r.status_code == 429, "6 failures from one address: back-off on any account"
    assert _try(admin, PASSWORD).status_code == 302


def test_distributed_guessing_backs_off_the_account_not_one_address(app: Flask) -> None:
    from web.admin.auth import Backoff, LoginThrottle

    svc = app.extensions["tokenfleet.tenancy"]
    clock = _Clock()
    app.extensions["tokenfleet.admin.throttle"] = LoginThrottle(
        svc.redis, svc.directory.prefix, account=Backoff(free=3, max_s=60.0), clock=clock
    )
    for i in range(3):
        c = app.test_client()
        c.environ_base["REMOTE_ADDR"] = f"10.9.0.{i}"
        assert _try(c, "wrong").status_code == 401
    fresh = app.test_client()
    fresh.environ_base["REMOTE_ADDR"] = "10.9.1.1"
    r = _try(fresh, PASSWORD)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) == 1
    clock.now += 1
    assert _try(fresh, PASSWORD).status_code == 302


# ---- real Chromium against the live stack ---------------------------------------------------
def _ensure_browser() -> str | None:
    """None if Chromium and playwright are usable (installing them if needed), else why not."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "playwright"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0:
            return (
                f"the playwright package is missing and `pip install playwright` failed: "
                f"{r.stderr.strip()[-300:]}"
            )
    if not Path(CHROMIUM).exists():
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return f"{CHROMIUM} is missing and apt-get is not usable here (need root on Debian)"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=600, env=env)
        r = subprocess.run(
            ["apt-get", "install", "-y", "-qq", "chromium"],
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        if r.returncode != 0 or not Path(CHROMIUM).exists():
            return f"`apt-get install chromium` failed: {r.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    why = _ensure_browser()
    if why is not None:
        pytest.skip(f"no browser for the Playwright tests: {why}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        yield b
        b.close()


@pytest.fixture(scope="module")
def live(live_stack: Any) -> Iterator[Any]:
    with live_stack(router="round_robin", time_scale=0.02) as stack:
        svc = stack.app.extensions["tokenfleet.tenancy"]
        set_admin_password(svc.engine, "root", PASSWORD, actor="test")
        start_runner(stack.app)  # the live stack turns the API's runner off by default
        yield stack
        svc.close()


def shot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def test_admin_journey_in_chromium(browser: Any, live: Any) -> None:
    import openai

    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.set_default_timeout(15_000)
    base = live.url
    # log in
    page.goto(base + "/admin/")
    assert "/admin/login" in page.url
    page.fill("input[name=username]", "root")
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_selector("#chart-goodput")
    page.wait_for_selector("#instances tbody tr")
    assert page.locator("#instances .pill.ok").count() == 2  # a0 and b0 healthy
    # goodput is the product's: output tokens/s within SLO; the shares are explained
    assert "output tokens/s within SLO" in (page.text_content("#chart-goodput .chart-title") or "")
    assert "never capped" in page.inner_text("#share-help")
    shot(page, "01-dashboard")
    # the models page: what is deployed and ready, per DC
    page.click("header.top >> text=Models")
    rows = page.locator("#models tbody tr")
    rows.first.wait_for()
    text = page.inner_text("#models")
    assert live.model in text and "dc-a" in text and "dc-b" in text
    assert page.locator("#models .pill.ok").count() == 2 and "not ready" not in text
    # create a tenant
    page.click("text=Tenants")
    page.fill("#create-tenant input[name=tenant_id]", "browser-co")
    page.fill("#create-tenant input[name=name]", "Browser Co")
    page.click("#create-tenant button[type=submit]")
    page.wait_for_url("**/admin/tenants/browser-co")
    # set a quota: 3 requests per minute on the interactive budget
    page.fill("#quota-interactive input[name=requests_per_minute]", "3")
    page.click("#quota-interactive button[type=submit]")
    page.wait_for_selector("text=interactive quota of browser-co saved")
    # a key, shown once, expiring in 30 days; its expiry and last use are listed
    page.fill("#create-key input[name=expires_days]", "30")
    page.click("#create-key button[type=submit]")
    key = page.inner_text("#new-key").strip()
    assert key.startswith("tf-")
    expires = page.inner_text("#keys tr[data-key] .expires")
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d", expires), expires
    assert page.inner_text("#keys tr[data-key] .last-used") == "not yet"
    shot(page, "02-tenant-quota-key")

    # the API enforces the quota: 3 pass, the 4th is a 429 naming the limit
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)
    msgs = [{"role": "user", "content": "hello"}]
    for _ in range(3):
        client.chat.completions.create(model=live.model, messages=msgs, max_tokens=4)
    r = requests.post(
        base + "/v1/chat/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": live.model, "messages": msgs, "max_tokens": 4},
    )
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "requests_per_minute_exceeded"
    assert 1 <= int(r.headers["Retry-After"]) <= 20  # 1 request refills in 20 s at 3/min
    page.reload()
    assert "0 requests" in page.inner_text("#quota-interactive + p")
    # the tenant's own usage over time, from the ledger (whose rows are written in batches)
    drawn = "#chart-tenant-output polyline, #chart-tenant-output circle"
    deadline = time.monotonic() + 30
    while page.locator(drawn).count() == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        page.reload()
    assert page.locator(drawn).count() >= 1
    assert "output tokens/s" in (page.text_content("#chart-tenant-output .chart-title") or "")

    # a batch that fails validation says why, in the list and on its own page
    bad = client.files.create(file=("bad.jsonl", io.BytesIO(b"not json\n")), purpose="batch")
    failed = client.batches.create(
        input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page.click("text=Batches")
    bad_row = page.locator(f"tr[data-batch='{failed.id}']")
    bad_row.wait_for()
    deadline = time.monotonic() + 60
    while "failed" not in bad_row.inner_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert bad_row.locator(".why").inner_text().strip(), bad_row.inner_text()
    bad_row.locator(f"a:text('{failed.id}')").click()
    page.wait_for_selector("#batch-errors")
    assert "line" in page.inner_text("#batch-errors").lower()
    shot(page, "02b-failed-batch")

    # a batch through the live path; watch its progress bar fill on the batches page
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": live.model,
                    "max_tokens": 6,
                    "messages": [{"role": "user", "content": f"q{i}"}],
                },
            }
        )
        + "\n"
        for i in range(40)
    )
    f = client.files.create(file=("job.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page.click("text=Batches")
    row = page.locator(f"tr[data-batch='{batch.id}']")
    row.wait_for()
    seen = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        seen.add(int(row.locator("progress").get_attribute("value") or 0))
        if "completed" in row.inner_text():
            break
        time.sleep(0.2)
    assert "completed" in row.inner_text(), row.inner_text()
    assert row.locator(".counts").inner_text().strip() == "40 / 0 / 40"
    shot(page, "03-batches")
    out = client.files.content(client.batches.retrieve(batch.id).output_file_id).text
    assert sorted(json.loads(x)["custom_id"] for x in out.splitlines()) == sorted(
        f"c{i}" for i in range(40)
    )
    # the audit log shows what the admin did
    page.click("text=Audit log")
    text = page.inner_text("#audit")
    for action in ("admin.login", "tenant.create", "tenant.set_quota", "key.create"):
        assert action in text
    shot(page, "04-audit")
    page.goto(base + "/admin/")
    page.wait_for_selector("#chart-goodput polyline, #chart-goodput circle")
    # every chart's text lies inside its own drawing (no clipped last time label),
    # y ticks are round (steps of 1, 2 or 5 x 10^k; 25 for percentages), and the
    # legend lists the tiers in the same order on every chart
    outside = page.evaluate(
        """() => [...document.querySelectorAll('svg.chart')].flatMap(svg => {
             const vb = svg.viewBox.baseVal;
             return [...svg.querySelectorAll('text')].filter(t => {
               const b = t.getBBox();
               return b.x < -0.5 || b.x + b.width > vb.width + 0.5;
             }).map(t => svg.id + ': ' + t.textContent);
           })"""
    )
    assert outside == [], outside
    for chart in ("#chart-goodput", "#chart-attainment"):
        ticks = [
            float(t)
            for t in page.eval_on_selector_all(
                chart + " text.ytick", "els => els.map(e => e.textContent)"
            )
        ]
        step = ticks[1] - ticks[0]
        assert all(abs((b - a) - step) < 1e-9 for a, b in zip(ticks, ticks[1:], strict=False))
        lead = float(f"{step:e}".split("e")[0])
        assert lead in (1.0, 2.0, 2.5, 5.0), ticks
    legends = [
        page.eval_on_selector_all(c + " text.legend", "els => els.map(e => e.textContent)")
        for c in ("#chart-goodput", "#chart-attainment")
    ]
    assert legends[0] == legends[1] and legends[0], legends
    shot(page, "05-dashboard-after-traffic")
    page.close()

    # a phone: nothing is wider than the screen (charts, grids, the header)
    phone = browser.new_page(viewport={"width": 375, "height": 740})
    phone.set_default_timeout(15_000)
    phone.goto(base + "/admin/login")
    phone.fill("input[name=username]", "root")
    phone.fill("input[name=password]", PASSWORD)
    phone.click("button[type=submit]")
    phone.wait_for_selector("#chart-goodput")
    for path in ("/admin/", "/admin/models", "/admin/tenants/browser-co", "/admin/batches"):
        phone.goto(base + path)
        width = phone.evaluate("() => document.documentElement.scrollWidth")
        assert width <= 375, f"{path} is {width}px wide on a 375px screen"
        chart_w = phone.evaluate(
            "() => Math.max(0, ...[...document.querySelectorAll('svg.chart')]"
            ".map(s => s.getBoundingClientRect().right))"
        )
        assert chart_w <= 375, f"{path}: a chart ends at {chart_w}px"
    shot(phone, "06-phone-dashboard")
    phone.close()
