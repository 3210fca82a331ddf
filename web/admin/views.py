"""The admin UI: server-rendered pages under ``/admin`` (Flask + Jinja, no CDN).

Every POST is CSRF-checked before the view runs, and every mutation goes
through :mod:`tokenfleet.tenancy.admin` or the batch job functions, which
write the audit log in the same transaction as the change.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from flask import (
    Blueprint,
    Response,
    abort,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from werkzeug.exceptions import HTTPException

from tokenfleet.batch import jobs
from tokenfleet.errors import TokenFleetError
from tokenfleet.service.db import session_scope
from tokenfleet.service.queries import append_audit
from tokenfleet.tenancy import admin as tenants
from tokenfleet.tenancy.quota import BUDGETS, LIMIT_NAMES
from tokenfleet.tenancy.usage import usage_for
from web.admin import auth, charts, data

admin_bp = Blueprint(
    "admin",
    __name__,
    url_prefix="/admin",
    template_folder="templates",
    static_folder="static",
    static_url_path="/static",
)

LIMIT_LABELS = {
    "expires_days": "expires in (days)",
    "key_requests_per_minute": "the key's requests / min",
    "key_tokens_per_minute": "the key's tokens / min",
    "requests_per_minute": "requests / min",
    "tokens_per_minute": "tokens / min",
    "max_concurrent_requests": "concurrent requests",
    "daily_token_budget": "tokens / day (UTC)",
}


def svc() -> Any:
    return current_app.extensions["tokenfleet.tenancy"]


def sampler() -> data.QueueSampler | None:
    return current_app.extensions.get("tokenfleet.admin.sampler")


@admin_bp.before_request
def _guard() -> None:
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        auth.check_csrf()


@admin_bp.after_request
def _headers(resp: Response) -> Response:
    resp.headers["Content-Security-Policy"] = (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "frame-ancestors 'none'; form-action 'self'"
    )
    resp.headers["X-Frame-Options"] = "DENY"
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "same-origin"
    if not request.path.startswith("/admin/static"):
        resp.headers["Cache-Control"] = "no-store"
    return resp


@admin_bp.errorhandler(HTTPException)
def _http_error(err: HTTPException) -> tuple[str, int]:
    return render_template(
        "admin/error.html", error=err, admin=session.get("admin_user")
    ), err.code or 500


@admin_bp.app_context_processor
def _inject() -> dict[str, Any]:
    return {
        "csrf_token": auth.csrf_token,
        "LIMIT_LABELS": LIMIT_LABELS,
        "BUDGETS": BUDGETS,
        "LIMIT_NAMES": LIMIT_NAMES,
    }


def _safe_next(target: str | None) -> str:
    if not target:
        return url_for("admin.dashboard")
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/admin"):
        return url_for("admin.dashboard")
    return target


# ---- login -------------------------------------------------------------------------
@admin_bp.route("/login", methods=["GET", "POST"])
def login() -> Any:
    s = svc()
    no_admins = auth.admin_count(s.engine) == 0
    error = None
    status = 200
    headers: dict[str, str] = {}
    if request.method == "POST":
        client = request.remote_addr or "?"
        username = request.form.get("username", "")[:100]
        throttle: auth.LoginThrottle = current_app.extensions["tokenfleet.admin.throttle"]
        wait_s = throttle.wait_s(username, client)
        if wait_s > 0:
            # not checked, not audited: the back-off bounds how often this can happen
            error = (
                f"too many failed logins for this account from this address; "
                f"try again in {math.ceil(wait_s)} s"
            )
            status = 429
            headers["Retry-After"] = str(math.ceil(wait_s))
        else:
            fp = auth.check_login(s.engine, username, request.form.get("password", ""))
            if fp is not None:
                throttle.succeeded(username, client)
                sessions: auth.AdminSessions = current_app.extensions["tokenfleet.admin.sessions"]
                session.clear()
                session["admin_user"] = username
                session["admin_fp"] = fp
                session["sid"] = sessions.create(username)
                session.permanent = True
                auth.csrf_token()
                with session_scope(s.engine) as db:
                    append_audit(db, f"admin:{username}", "admin.login", {"addr": client})
                return redirect(_safe_next(request.args.get("next")))
            backoff_s = throttle.failed(username, client)
            with session_scope(s.engine) as db:
                append_audit(
                    db,
                    f"anonymous@{client}"[:200],
                    "admin.login_failed",
                    {"username": username, "addr": client, "backoff_s": backoff_s},
                )
            error = "wrong user name or password"
            status = 401
    return render_template("admin/login.html", error=error, no_admins=no_admins), status, headers


@admin_bp.post("/logout")
def logout() -> Any:
    user = session.get("admin_user")
    sid = session.get("sid")
    if sid:  # ends it on the server: the same cookie replayed later is refused
        current_app.extensions["tokenfleet.admin.sessions"].end(str(sid))
    session.clear()
    if user:
        with session_scope(svc().engine) as db:
            append_audit(db, f"admin:{user}", "admin.logout", {})
    return redirect(url_for("admin.login"))


# ---- dashboard --------------------------------------------------------------------------
def _dashboard_context() -> dict[str, Any]:
    s = svc()
    gw = current_app.extensions.get("tokenfleet")
    series = data.tier_series(s.engine)
    live = data.live_view(gw)
    smp = sampler()
    if smp is not None:
        smp.sample()
    batches, _ = jobs.list_batches(s.engine, None, limit=10)
    return {
        "live": live,
        "goodput_chart": charts.line_chart(
            series["goodput"],
            title="goodput per tier",
            unit="output tokens/s within SLO",
            chart_id="chart-goodput",
        ),
        "attainment_chart": charts.line_chart(
            series["attainment"],
            title="SLO attainment",
            unit="% of requests",
            y_max=100.0,
            chart_id="chart-attainment",
        ),
        "queue_chart": charts.line_chart(
            smp.series() if smp else {},
            title="queue depth",
            unit="requests",
            chart_id="chart-queue",
        ),
        "share_chart": charts.share_bars(live.shares) if live.shares else None,
        "share_history": data.share_history(s.engine),
        "fleet_events": data.fleet_events(s.engine),
        "batches": [jobs.batch_object(b) | {"tenant_id": b.tenant_id} for b in batches],
    }


@admin_bp.get("/")
@auth.login_required
def dashboard() -> Any:
    return render_template(
        "admin/dashboard.html", admin=session["admin_user"], **_dashboard_context()
    )


@admin_bp.get("/live")
@auth.login_required
def live_fragment() -> Any:
    """The dashboard's live part, re-fetched every few seconds by admin.js."""
    return render_template("admin/_live.html", **_dashboard_context())


# ---- tenants ------------------------------------------------------------------------------
def _form_limit(name: str) -> int | None:
    raw = (request.form.get(name) or "").strip()
    if raw == "" or raw.lower() in ("none", "unlimited"):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise TokenFleetError(
            f"{LIMIT_LABELS.get(name, name)}: '{raw}' is not a whole number "
            "(leave empty for unlimited)"
        ) from None
    if value < 0:
        raise TokenFleetError(f"{LIMIT_LABELS.get(name, name)} must be >= 0")
    return value


def _csv(name: str) -> list[str]:
    return [p.strip() for p in (request.form.get(name) or "").split(",") if p.strip()]


@admin_bp.get("/tenants")
@auth.login_required
def tenant_list() -> Any:
    return render_template(
        "admin/tenants.html",
        admin=session["admin_user"],
        tenants=tenants.list_tenants(svc().engine),
    )


@admin_bp.post("/tenants")
@auth.login_required
def tenant_create() -> Any:
    s = svc()
    tid = (request.form.get("tenant_id") or "").strip()
    try:
        tenants.create_tenant(
            s.engine,
            tid,
            actor=auth.actor(),
            name=(request.form.get("name") or "").strip() or None,
            slo_class=request.form.get("slo_class") or "standard",
            allowed_models=_csv("allowed_models"),
            allowed_regions=_csv("allowed_regions"),
            cache=s.directory,
        )
    except TokenFleetError as exc:
        flash(str(exc), "error")
        return redirect(url_for("admin.tenant_list"))
    flash(f"tenant {tid} created", "ok")
    return redirect(url_for("admin.tenant_detail", tenant_id=tid))


@admin_bp.get("/tenants/<tenant_id>")
@auth.login_required
def tenant_detail(tenant_id: str) -> Any:
    s = svc()
    ctx = tenants.get_tenant(s.engine, tenant_id)
    if ctx is None:
        abort(404, description=f"no tenant '{tenant_id}'")
    now = {b: s.quotas.state(tenant_id, b, ctx.quotas.for_budget(b)) for b in BUDGETS}
    new_key = session.pop("new_key", None)
    if new_key and new_key.get("tenant") != tenant_id:
        new_key = None
    series = data.tier_series(s.engine, tenant=tenant_id, window_s=6 * 3600, bucket_s=300)
    return render_template(
        "admin/tenant.html",
        admin=session["admin_user"],
        usage_chart=charts.line_chart(
            series["output"],
            title=f"{tenant_id}: output tokens/s, last 6 h",
            unit="5-min means",
            chart_id="chart-tenant-output",
        ),
        goodput_chart=charts.line_chart(
            series["goodput"],
            title=f"{tenant_id}: goodput, last 6 h",
            unit="output tokens/s within SLO",
            chart_id="chart-tenant-goodput",
        ),
        t=ctx,
        now=now,
        keys=tenants.list_keys(s.engine, tenant_id),
        now_utc=datetime.now(UTC),
        usage=usage_for(s.engine, tenant_id)[:14],
        new_key=new_key,
    )


@admin_bp.post("/tenants/<tenant_id>/quota/<budget>")
@auth.login_required
def tenant_quota(tenant_id: str, budget: str) -> Any:
    s = svc()
    try:
        changes = {name: _form_limit(name) for name in LIMIT_NAMES}
        tenants.set_quota(
            s.engine, tenant_id, budget, changes, actor=auth.actor(), cache=s.directory
        )
        flash(f"{budget} quota of {tenant_id} saved", "ok")
    except TokenFleetError as exc:
        flash(str(exc), "error")
    return redirect(url_for("admin.tenant_detail", tenant_id=tenant_id))


@admin_bp.post("/tenants/<tenant_id>/settings")
@auth.login_required
def tenant_settings(tenant_id: str) -> Any:
    s = svc()
    try:
        tenants.update_tenant(
            s.engine,
            tenant_id,
            actor=auth.actor(),
            name=(request.form.get("name") or "").strip() or None,
            slo_class=request.form.get("slo_class") or None,
            allowed_models=_csv("allowed_models"),
            allowed_regions=_csv("allowed_regions"),
            disabled=request.form.get("disabled") == "on",
            cache=s.directory,
        )
        flash(f"settings of {tenant_id} saved", "ok")
    except TokenFleetError as exc:
        flash(str(exc), "error")
    return redirect(url_for("admin.tenant_detail", tenant_id=tenant_id))


@admin_bp.post("/tenants/<tenant_id>/keys")
@auth.login_required
def key_create(tenant_id: str) -> Any:
    s = svc()
    try:
        days = _form_limit("expires_days")
        key, info = tenants.create_key(
            s.engine,
            tenant_id,
            actor=auth.actor(),
            name=(request.form.get("name") or "").strip() or None,
            expires_at=datetime.now(UTC) + timedelta(days=days) if days else None,
            requests_per_minute=_form_limit("key_requests_per_minute"),
            tokens_per_minute=_form_limit("key_tokens_per_minute"),
            cache=s.directory,
        )
    except TokenFleetError as exc:
        flash(str(exc), "error")
        return redirect(url_for("admin.tenant_detail", tenant_id=tenant_id))
    # shown once: kept in the (signed, HttpOnly) session only until the next page view
    session["new_key"] = {"tenant": tenant_id, "key": key, "id": info.id}
    return redirect(url_for("admin.tenant_detail", tenant_id=tenant_id))


@admin_bp.post("/tenants/<tenant_id>/keys/<int:key_id>/revoke")
@auth.login_required
def key_revoke(tenant_id: str, key_id: int) -> Any:
    s = svc()
    n = tenants.revoke_key(
        s.engine, str(key_id), actor=auth.actor(), tenant_id=tenant_id, cache=s.directory
    )
    flash(f"key {key_id} revoked" if n else f"key {key_id} was not active", "ok" if n else "error")
    return redirect(url_for("admin.tenant_detail", tenant_id=tenant_id))


# ---- batches and audit ----------------------------------------------------------------------
@admin_bp.get("/batches")
@auth.login_required
def batch_list() -> Any:
    rows, _ = jobs.list_batches(svc().engine, None, limit=100)
    return render_template(
        "admin/batches.html",
        admin=session["admin_user"],
        batches=[jobs.batch_object(b) | {"tenant_id": b.tenant_id} for b in rows],
    )


@admin_bp.get("/batches/<batch_id>")
@auth.login_required
def batch_detail(batch_id: str) -> Any:
    """One batch: its timeline, counts and why it failed (the job's ``errors``)."""
    s = svc()
    owner = jobs.batch_owner(s.engine, batch_id)
    if owner is None:
        abort(404, description=f"no batch {batch_id}")
    row = jobs.get_batch(s.engine, owner, batch_id)
    if row is None:
        abort(404, description=f"no batch {batch_id}")
    return render_template(
        "admin/batch.html",
        admin=session["admin_user"],
        b=jobs.batch_object(row) | {"tenant_id": owner},
        lines=jobs.line_counts(s.engine, batch_id),
    )


# ---- models --------------------------------------------------------------------------------
@admin_bp.get("/models")
@auth.login_required
def models() -> Any:
    gw = current_app.extensions.get("tokenfleet")
    try:
        rows, error = data.models_view(gw), ""
    except Exception as exc:  # noqa: BLE001 - show the page anyway
        rows, error = [], f"live state store unavailable ({exc.__class__.__name__})"
    if gw is None:
        error = "this process does not run the live request path"
    return render_template("admin/models.html", admin=session["admin_user"], rows=rows, error=error)


@admin_bp.post("/batches/<batch_id>/cancel")
@auth.login_required
def batch_cancel(batch_id: str) -> Any:
    s = svc()
    owner = jobs.batch_owner(s.engine, batch_id)
    if owner is None:
        abort(404, description=f"no batch {batch_id}")
    try:
        jobs.cancel_batch(s.engine, owner, batch_id)
        with session_scope(s.engine) as db:
            append_audit(
                db, auth.actor(), "batch.cancel", {"batch_id": batch_id, "tenant_id": owner}
            )
        flash(f"batch {batch_id} is being cancelled", "ok")
    except TokenFleetError as exc:
        flash(str(exc), "error")
    return redirect(url_for("admin.batch_list"))


@admin_bp.get("/audit")
@auth.login_required
def audit() -> Any:
    return render_template(
        "admin/audit.html",
        admin=session["admin_user"],
        rows=tenants.audit_log(svc().engine, limit=200),
    )


@admin_bp.app_template_filter("utc")
def _utc(ts: int) -> str:
    return datetime.fromtimestamp(int(ts), UTC).strftime("%Y-%m-%d %H:%M") if ts else ""
