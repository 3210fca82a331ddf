"""The other routes: ``/v1/models`` and the operational endpoints."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import redis
from flask import Blueprint, Response, current_app, request

from tokenfleet.live.gateway import Gateway
from web.errors import ApiError

models_bp = Blueprint("models", __name__, url_prefix="/v1")
ops_bp = Blueprint("ops", __name__)


def gateway() -> Gateway:
    gw: Gateway = current_app.extensions["tokenfleet"]
    return gw


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    resp = Response(json.dumps(obj), status=status, mimetype="application/json")
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def _models() -> dict[str, int]:
    current_app.extensions["tokenfleet.auth"].authenticate(request.headers.get("Authorization"))
    try:
        return gateway().models()
    except redis.RedisError:
        raise ApiError(
            503,
            "the live state store is unavailable; retry shortly",
            code="service_unavailable",
            retry_after_s=2,
        ) from None


@models_bp.get("/models")
def list_models() -> Response:
    models = _models()
    created = int(time.time())
    return _json(
        {
            "object": "list",
            "data": [
                {
                    "id": m,
                    "object": "model",
                    "created": created,
                    "owned_by": "tokenfleet",
                    "max_model_len": n,
                }
                for m, n in sorted(models.items())
            ],
        }
    )


@models_bp.get("/models/<path:model>")
def get_model(model: str) -> Response:
    models = _models()
    if model not in models and "%" in model:
        # the official client sends "meta-llama%2FLlama-3.1-8B-Instruct" (it quotes the
        # slash) and the server keeps %2F encoded in the path: both forms name one model
        model = unquote(model)
    if model not in models:
        raise ApiError(
            404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )
    return _json(
        {
            "id": model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tokenfleet",
            "max_model_len": models[model],
        }
    )


@ops_bp.get("/health")
def health() -> Response:
    gw = gateway()
    try:
        h = gw.health()
    except redis.RedisError as exc:
        return _json(
            {"status": "unavailable", "redis": f"down: {exc.__class__.__name__}"},
            503,
            {"Retry-After": "2"},
        )
    return _json(*health_answer(gw, h))


def health_answer(
    gw: Gateway, h: dict[str, Any], pending: int | None = None
) -> tuple[dict[str, Any], int, dict[str, str]]:
    """``/health``'s body, status and headers from :meth:`Gateway.health`'s view
    (``pending``: the ledger's unwritten rows, when the caller has them)."""
    healthy = h["healthy"]
    body: dict[str, Any] = {
        "status": "ok" if healthy else "degraded",
        "redis": "ok",
        "instances": h["instances"],
    }
    ledger = gw.ledger
    if ledger is not None:
        if pending is None:
            pending = ledger.pending()
        body["ledger"] = {"healthy": ledger.stats.healthy, "pending": pending}
    return body, 200 if healthy else 503, {} if healthy else {"Retry-After": "2"}


def inline_health(gw: Gateway) -> Callable[[], tuple[int, bytes, dict[str, str]] | None]:
    """``/health`` for the server to answer on its own connection thread
    (``web.server``): status, JSON body and headers from the gateway's copy,
    without I/O; None when only the route can say (the copy is old, so it asks
    Redis), and the request goes to a pool thread as any other."""

    def answer() -> tuple[int, bytes, dict[str, str]] | None:
        h = gw.cached_health()
        if h is None:
            return None
        pending = None
        if gw.ledger is not None:
            pending = gw.ledger.pending_now()
            if pending is None:  # its writer holds the lock: a pool thread may wait
                return None
        body, status, headers = health_answer(gw, h, pending)
        return status, json.dumps(body).encode(), headers

    return answer


@ops_bp.get("/metrics")
def metrics() -> Response:
    m = current_app.extensions["tokenfleet.metrics"]
    from web.metrics import CONTENT_TYPE

    # content_type, not mimetype: Flask would append a second "; charset=utf-8"
    return Response(m.render(), content_type=CONTENT_TYPE)


@ops_bp.get("/openapi.json")
def openapi() -> Response:
    from web.openapi import document

    doc = document()
    if "tokenfleet.tenancy" in current_app.extensions:  # /v1/files, /v1/batches, /v1/usage
        from web.batch_api.openapi import merge_into

        doc = merge_into(doc)
    return _json(doc)
