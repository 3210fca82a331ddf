"""``POST /v1/chat/completions``: one request, read top to bottom.

authenticate -> parse the JSON body -> ``gateway.validate`` (the prompt is
tokenized once) -> charge the tenant's quota -> ``gateway.dispatch`` (Celery)
-> relay the events the worker writes to the request's stream, as one JSON
answer or as server-sent events -> reconcile the quota with the usage. The
worker writes the ledger row; nothing comes back up through this view but the
stream. Refusals are raised (``GatewayError``, ``TenancyError``, ``ApiError``)
and turned into OpenAI-shaped responses by ``web.create_app``'s handlers; a
429 or 503 refusal also leaves a ``rejected`` ledger row (attainment counts
it), and every answer, errors included, carries ``X-Request-Id``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import redis
from flask import Blueprint, Response, current_app, g, request

from tokenfleet.live.gateway import TIER_HEADER, ChatRequest, Dispatched, Gateway
from tokenfleet.live.gateway.rows import REFUSAL_STATUSES, refusal_record
from tokenfleet.live.relay import RelayEvent
from web.errors import ApiError
from web.limits import read_json
from web.quota import ChatQuota

chat_bp = Blueprint("openai", __name__, url_prefix="/v1")


@chat_bp.post("/chat/completions")
def chat_completions() -> Response:
    gw: Gateway = current_app.extensions["tokenfleet"]
    principal = current_app.extensions["tokenfleet.auth"].authenticate(
        request.headers.get("Authorization")
    )
    body = read_json()
    tier_hint = request.headers.get(TIER_HEADER, "") or ""
    req: ChatRequest | None = None
    try:
        req = gw.validate(
            body, tenant=principal.tenant, slo_class=principal.slo_class, tier_hint=tier_hint
        )
        g.tf_request_id = req.info.request_id
        quota = ChatQuota.admit(current_app.extensions.get("tokenfleet.quota"), principal, req)
    except Exception as exc:
        _record_refusal(gw, principal.tenant, body, req, tier_hint, exc)
        raise
    try:
        try:
            d = gw.dispatch(req)
        except Exception as exc:
            _record_refusal(gw, principal.tenant, body, req, tier_hint, exc)
            raise
        events = gw.events(d)
        if not req.stream:
            resp, usage = _complete(d, events)
            quota.finish(usage)
            return resp
        # Hold the response until the first real event so an error before any
        # token still gets its proper HTTP status; after that, errors are events.
        first = next((ev for ev in events if ev.kind in ("d", "end", "err")), None)
        if first is None or first.kind == "err":
            raise _event_error(first)
    except BaseException:
        quota.refund()
        raise
    return Response(
        _sse(gw, d, first, events, quota),
        mimetype="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Request-Id": req.info.request_id,
        },
    )


@chat_bp.after_request
def _request_id_header(resp: Response) -> Response:
    """Errors too name their request, so a client can find its ledger row."""
    rid = g.get("tf_request_id")
    if rid and "X-Request-Id" not in resp.headers:
        resp.headers["X-Request-Id"] = rid
    return resp


def _record_refusal(
    gw: Gateway, tenant: str, body: Any, req: ChatRequest | None, tier_hint: str, exc: Exception
) -> None:
    """A 429/503 refusal is a request the service did not serve: one ``rejected``
    row (400-class errors are the client's mistakes, not requests)."""
    status = 503 if isinstance(exc, redis.RedisError) else getattr(exc, "status", None)
    if status not in REFUSAL_STATUSES:
        return
    row = refusal_record(
        tenant=tenant,
        body=body,
        req=req,
        tier_hint=tier_hint,
        tiers=gw.slo.tiers,
        message=str(getattr(exc, "message", None) or exc) or f"refused ({status})",
    )
    g.tf_request_id = row.request_id
    gw.record(row)


def _event_error(ev: RelayEvent | None) -> ApiError:
    if ev is None:
        return ApiError(502, "no answer")
    return ApiError(
        ev.code if ev.code >= 400 else 502,
        ev.message,
        code=ev.error_type,
        retry_after_s=2 if ev.code in (429, 503) else None,
    )


def _chunk(d: Dispatched, delta: dict[str, Any], finish: str | None = None) -> bytes:
    r = d.request
    obj = {
        "id": f"chatcmpl-{r.info.request_id}",
        "object": "chat.completion.chunk",
        "created": r.created,
        "model": r.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _sse(
    gw: Gateway, d: Dispatched, first: RelayEvent, events: Iterator[RelayEvent], quota: ChatQuota
) -> Iterator[bytes]:
    r = d.request
    finished = False
    usage: dict[str, Any] | None = None
    try:
        head = _chunk(d, {"role": "assistant", "content": ""})
        if first.kind == "d" and first.text:
            # the role chunk and the first token leave in one write
            yield head + _chunk(d, {"content": first.text})
        else:
            yield head
            events = itertools.chain([first], events)
        for ev in events:
            if ev.kind == "d":
                if ev.text:
                    yield _chunk(d, {"content": ev.text})
            elif ev.kind == "idle":
                yield b": keep-alive\n\n"
            elif ev.kind == "end":
                finished = True
                usage = ev.usage
                yield _chunk(d, {}, ev.finish_reason or "stop")
                if r.include_usage:
                    obj = {
                        "id": f"chatcmpl-{r.info.request_id}",
                        "object": "chat.completion.chunk",
                        "created": r.created,
                        "model": r.model,
                        "choices": [],
                        "usage": ev.usage,
                    }
                    yield b"data: " + json.dumps(obj).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
            elif ev.kind == "err":
                finished = True
                err = {
                    "error": {
                        "message": ev.message,
                        "type": ev.error_type or "server_error",
                        "param": None,
                        "code": ev.code,
                    }
                }
                yield b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n"
                return
    finally:
        if not finished:
            gw.cancel(d)
        quota.finish(usage)


def _complete(
    d: Dispatched, events: Iterator[RelayEvent]
) -> tuple[Response, dict[str, Any] | None]:
    r = d.request
    parts: list[str] = []
    for ev in events:
        if ev.kind == "d":
            parts.append(ev.text)
        elif ev.kind == "err":
            raise _event_error(ev)
        elif ev.kind == "end":
            body = {
                "id": f"chatcmpl-{r.info.request_id}",
                "object": "chat.completion",
                "created": r.created,
                "model": r.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(parts)},
                        "logprobs": None,
                        "finish_reason": ev.finish_reason or "stop",
                    }
                ],
                "usage": ev.usage,
            }
            resp = Response(
                json.dumps(body),
                mimetype="application/json",
                headers={"X-Request-Id": r.info.request_id},
            )
            return resp, ev.usage
    raise ApiError(502, "the request ended without an answer", code="server_error")
