"""Blueprints: the OpenAI-compatible API and the operational endpoints."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any, Iterator

import redis
from flask import Blueprint, Response, current_app, request

from web.errors import ApiError
from web.gateway import Dispatched, Gateway

openai_bp = Blueprint("openai", __name__, url_prefix="/v1")
ops_bp = Blueprint("ops", __name__)


def gateway() -> Gateway:
    gw: Gateway = current_app.extensions["tokenfleet"]
    return gw


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    resp = Response(json.dumps(obj), status=status, mimetype="application/json")
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def _body() -> Any:
    raw = request.get_data(cache=False)
    if not raw:
        raise ApiError(400, "We could not parse the JSON body of your request: the body is "
                       "empty. Send a JSON object.", code="invalid_json")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request ({exc}). "
                       "Send valid JSON.", code="invalid_json") from None


@openai_bp.post("/chat/completions")
def chat_completions() -> Response:
    gw = gateway()
    principal = current_app.extensions["tokenfleet.auth"].authenticate(
        request.headers.get("Authorization"))
    body = _body()
    try:
        prep = gw.prepare(body, principal.tenant, request.headers, principal.slo_class)
        d = gw.dispatch(prep)
    except redis.RedisError as exc:
        raise ApiError(503, f"the live state store is unavailable ({exc.__class__.__name__}); "
                       "retry shortly", code="service_unavailable", retry_after_s=2) from None
    events = gw.events(d)
    if not prep.stream:
        return _complete(gw, d, events)
    # Hold the response until the first real event so an error before any
    # token still gets its proper HTTP status; after that, errors are events.
    first = None
    try:
        for ev in events:
            if ev.kind in ("d", "end", "err"):
                first = ev
                break
    except GeneratorExit:  # pragma: no cover
        raise
    if first is None or first.kind == "err":
        err = first
        raise ApiError(err.code if err else 502, err.message if err else "no answer",
                       code=err.error_type if err else None,
                       retry_after_s=2 if err and err.code in (429, 503) else None)
    return Response(_sse(gw, d, first, events), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                             "X-Request-Id": prep.info.request_id})


def _chunk(d: Dispatched, delta: dict[str, Any], finish: str | None = None) -> bytes:
    p = d.prep
    obj = {"id": f"chatcmpl-{p.info.request_id}", "object": "chat.completion.chunk",
           "created": p.created, "model": p.model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None,
                        "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _sse(gw: Gateway, d: Dispatched, first: Any, events: Iterator[Any]) -> Iterator[bytes]:
    p = d.prep
    finished = False
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
                yield _chunk(d, {}, ev.finish_reason or "stop")
                if p.include_usage:
                    obj = {"id": f"chatcmpl-{p.info.request_id}",
                           "object": "chat.completion.chunk", "created": p.created,
                           "model": p.model, "choices": [], "usage": ev.usage}
                    yield b"data: " + json.dumps(obj).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
            elif ev.kind == "err":
                finished = True
                err = {"error": {"message": ev.message, "type": ev.error_type or "server_error",
                                 "param": None, "code": ev.code}}
                yield b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n"
                return
    finally:
        if not finished:
            gw.cancel(d)


def _complete(gw: Gateway, d: Dispatched, events: Iterator[Any]) -> Response:
    p = d.prep
    parts: list[str] = []
    for ev in events:
        if ev.kind == "d":
            parts.append(ev.text)
        elif ev.kind == "err":
            raise ApiError(ev.code if ev.code >= 400 else 502, ev.message,
                           code=ev.error_type,
                           retry_after_s=2 if ev.code in (429, 503) else None)
        elif ev.kind == "end":
            body = {"id": f"chatcmpl-{p.info.request_id}", "object": "chat.completion",
                    "created": p.created, "model": p.model,
                    "choices": [{"index": 0,
                                 "message": {"role": "assistant", "content": "".join(parts)},
                                 "logprobs": None, "finish_reason": ev.finish_reason or "stop"}],
                    "usage": ev.usage}
            return _json(body, headers={"X-Request-Id": p.info.request_id})
    raise ApiError(502, "the request ended without an answer", code="server_error")


@openai_bp.get("/models")
def list_models() -> Response:
    current_app.extensions["tokenfleet.auth"].authenticate(request.headers.get("Authorization"))
    gw = gateway()
    try:
        models = gw.models()
    except redis.RedisError:
        raise ApiError(503, "the live state store is unavailable; retry shortly",
                       code="service_unavailable", retry_after_s=2) from None
    created = int(time.time())
    return _json({"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": "tokenfleet",
         "max_model_len": n} for m, n in sorted(models.items())]})


@openai_bp.get("/models/<path:model>")
def get_model(model: str) -> Response:
    current_app.extensions["tokenfleet.auth"].authenticate(request.headers.get("Authorization"))
    try:
        models = gateway().models()
    except redis.RedisError:
        raise ApiError(503, "the live state store is unavailable; retry shortly",
                       code="service_unavailable", retry_after_s=2) from None
    if model not in models:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                       code="model_not_found")
    return _json({"id": model, "object": "model", "created": int(time.time()),
                  "owned_by": "tokenfleet", "max_model_len": models[model]})


@ops_bp.get("/health")
def health() -> Response:
    gw = gateway()
    try:
        gw.state.r.ping()
        infos = gw.state.instances()
    except redis.RedisError as exc:
        return _json({"status": "unavailable", "redis": f"down: {exc.__class__.__name__}"},
                     503, {"Retry-After": "2"})
    now = time.time()
    healthy = [i.instance_id for i in infos if i.is_healthy(now, gw.live.stale_after_s)]
    body = {"status": "ok" if healthy else "degraded", "redis": "ok",
            "instances": {i.instance_id: {"dc": i.dc, "healthy": i.instance_id in healthy,
                                          "age_s": round(max(0.0, i.age_s(now)), 3)}
                          for i in infos}}
    ledger = gw.ledger
    if ledger is not None:
        body["ledger"] = {"healthy": ledger.stats.healthy, "pending": ledger.pending()}
    return _json(body, 200 if healthy else 503, None if healthy else {"Retry-After": "2"})


@ops_bp.get("/metrics")
def metrics() -> Response:
    m = current_app.extensions["tokenfleet.metrics"]
    return Response(m.render(), mimetype="text/plain; version=0.0.4; charset=utf-8")


@ops_bp.get("/openapi.json")
def openapi() -> Response:
    from web.openapi import document

    return _json(document())
