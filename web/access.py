"""The access log: one line per API request, written when its answer has ended.

For ``/v1/*`` (not ``/health`` or ``/metrics`` scrapes) the line carries the
request id, tenant, tier, datacenter, instance, HTTP status, outcome
(completed, slo_missed, error, cancelled), TTFT, prompt and completion tokens
and the whole duration. A stream's line is written when the stream closes
(Werkzeug's ``call_on_close``), so its tokens and outcome are final. Logger
``tokenfleet.access`` at INFO; with ``TOKENFLEET_LOG_FORMAT=json`` the fields
are JSON keys (:mod:`tokenfleet.cli.logs`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flask import Flask, Response, g, request

from web.server import STATUS_KEY

log = logging.getLogger("tokenfleet.access")


def init_app(app: Flask) -> None:
    @app.before_request
    def _start() -> None:
        g.tf_start_s = time.time()

    @app.after_request
    def _after(resp: Response) -> Response:
        if not request.path.startswith("/v1/") or not log.isEnabledFor(logging.INFO):
            return resp
        base: dict[str, Any] = {
            "method": request.method,
            "path": request.path,
            "status": resp.status_code,
            "tenant": g.get("tf_tenant"),
            "tier": g.get("tf_tier"),
            "id": g.get("tf_request_id"),
        }
        start_s = g.get("tf_start_s") or time.time()
        d = g.get("tf_dispatched")
        environ = request.environ  # a stream's head may change before it is sent
        resp.call_on_close(lambda: _emit(base, d, start_s, environ))
        return resp


def access_fields(base: dict[str, Any], d: Any, start_s: float, now_s: float) -> dict[str, Any]:
    """The line's fields: what the view knew (``base``) and what the request's
    :class:`~tokenfleet.live.gateway.Dispatched` says at its end."""
    f = dict(base)
    if d is not None:
        info = d.request.info
        usage = d.extra.get("usage") or {}
        f.update(
            dc=d.job.dc or None,
            instance=d.instance or None,
            outcome=d.extra.get("outcome"),
            ttft_ms=(
                round((d.first_token_s - info.arrival_s) * 1000, 1)
                if d.first_token_s is not None
                else None
            ),
            prompt_tokens=int(usage.get("prompt_tokens", info.input_tokens)),
            completion_tokens=int(usage.get("completion_tokens", d.tokens)),
        )
    elif base["status"] >= 400:
        f["outcome"] = "refused"
    f["duration_ms"] = round((now_s - start_s) * 1000, 1)
    return f


def format_line(f: dict[str, Any]) -> str:
    """``key=value`` pairs, ``-`` for unknown: grep- and awk-friendly."""
    return " ".join(f"{k}={'-' if v is None else v}" for k, v in f.items())


def _emit(base: dict[str, Any], d: Any, start_s: float, environ: dict[str, Any]) -> None:
    try:
        status = environ.get(STATUS_KEY)  # the head a deferred stream sent instead
        if status is not None:
            base = {**base, "status": status}
        f = access_fields(base, d, start_s, time.time())
        log.info("%s", format_line(f), extra={"fields": f})
    except Exception:
        log.debug("access line not written", exc_info=True)
