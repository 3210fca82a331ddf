"""The other routes: ``/v1/models`` and the operational endpoints."""

from __future__ import annotations

import json
import time
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
    healthy = h["healthy"]
    body: dict[str, Any] = {
        "status": "ok" if healthy else "degraded",
        "redis": "ok",
        "instances": h["instances"],
    }
    ledger = gw.ledger
    if ledger is not None:
        body["ledger"] = {"healthy": ledger.stats.healthy, "pending": ledger.pending()}
    return _json(body, 200 if healthy else 503, None if healthy else {"Retry-After": "2"})


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
