"""``/v1/files`` and ``/v1/batches``: the OpenAI Files and Batch APIs, plus ``/v1/usage``.

Shapes follow the OpenAI API reference so the official ``openai`` client
works unchanged (``files.create/retrieve/content/list/delete``,
``batches.create/retrieve/list/cancel``). Every lookup is scoped to the
calling tenant; someone else's id answers exactly like an unknown one.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, Response, current_app, request, stream_with_context
from werkzeug.exceptions import RequestEntityTooLarge

from tokenfleet.batch import jobs
from tokenfleet.batch.files import UPLOAD_PURPOSES, FileTooLarge, file_object
from tokenfleet.errors import TokenFleetError
from tokenfleet.tenancy.directory import TenantContext
from tokenfleet.tenancy.gate import TenancyError
from tokenfleet.tenancy.quota import BUDGETS
from tokenfleet.tenancy.usage import usage_for
from web.batch_api.services import TenancyServices
from web.errors import ApiError
from web.limits import (
    MULTIPART_OVERHEAD_BYTES,
    body_over_cap,
    cap_body,
    limits,
    read_json,
    too_large,
)

batch_bp = Blueprint("batch_api", __name__, url_prefix="/v1")


def services() -> TenancyServices:
    svc: TenancyServices = current_app.extensions["tokenfleet.tenancy"]
    return svc


def tenant() -> TenantContext:
    """The caller's tenancy record (the app's one authenticator, :mod:`web.auth`)."""
    principal = current_app.extensions["tokenfleet.auth"].authenticate(
        request.headers.get("Authorization")
    )
    ctx: TenantContext = principal.context
    return ctx


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    resp = Response(json.dumps(obj), status=status, mimetype="application/json")
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def error(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    type_: str = "invalid_request_error",
) -> Response:
    return _json(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, status
    )


def not_found(kind: str, ident: str) -> Response:
    return error(404, f"No such {kind} object: {ident}", code="not_found")


@batch_bp.errorhandler(TenancyError)
def _tenancy_error(err: TenancyError) -> Response:
    return _json(err.body(), err.status, err.headers)


@batch_bp.errorhandler(ApiError)
def _api_error(err: ApiError) -> Response:  # a 401 from the authenticator
    return err.response()


@batch_bp.errorhandler(jobs.BatchRequestError)
def _batch_request_error(err: jobs.BatchRequestError) -> Response:
    return error(err.status, str(err), code=err.code, param=err.param)


@batch_bp.errorhandler(FileTooLarge)
def _too_large(err: FileTooLarge) -> Response:
    return error(413, str(err), code="file_too_large", param="file")


def _has_nul(value: Any) -> bool:
    """PostgreSQL text cannot hold NUL; such input is never a valid id or value."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


@batch_bp.before_request
def _reject_nul() -> Response | None:
    if any(_has_nul(v) for v in (request.view_args or {}).values()):
        return error(404, "No such object (the id contains a NUL character)", code="not_found")
    if any(_has_nul(v) for v in request.args.values()):
        return error(
            400, "query parameters must not contain NUL characters", code="invalid_parameter"
        )
    return None


def _json_body() -> dict[str, Any]:
    body = read_json(empty_ok=True)  # size and nesting limits (web.limits)
    if not isinstance(body, dict):
        raise jobs.BatchRequestError(
            400, "the request body must be a JSON object", code="invalid_json"
        )
    if _has_nul(body):
        raise jobs.BatchRequestError(
            400, "the request body must not contain NUL characters", code="invalid_json"
        )
    return body


def _limit(default: int, maximum: int) -> int:
    raw = request.args.get("limit")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise jobs.BatchRequestError(400, "limit must be an integer", param="limit") from None
    if not 1 <= value <= maximum:
        raise jobs.BatchRequestError(400, f"limit must be between 1 and {maximum}", param="limit")
    return value


# ---- files -------------------------------------------------------------------------
@batch_bp.post("/files")
def create_file() -> Response:
    lim = limits()
    cap_body(lim.max_upload_bytes + MULTIPART_OVERHEAD_BYTES, "file")
    who = tenant()
    try:
        purpose = request.form.get("purpose")
        upload = request.files.get("file")
    except RequestEntityTooLarge:
        raise too_large(lim.max_upload_bytes, "file") from None
    if body_over_cap():  # a chunked body cut off at the cap: its form is incomplete
        raise too_large(lim.max_upload_bytes, "file")
    if purpose not in UPLOAD_PURPOSES:
        return error(
            400,
            f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} (got {purpose!r})",
            param="purpose",
        )
    if upload is None:
        return error(400, "send the file as multipart/form-data field 'file'", param="file")
    filename = "".join(ch for ch in (upload.filename or "").rsplit("/", 1)[-1] if ch.isprintable())
    if not filename.endswith(".jsonl"):
        return error(
            400, "batch input files must be .jsonl", param="file", code="invalid_file_format"
        )
    f = services().files.upload(
        who.id, purpose, filename[:500], upload.stream, max_bytes=lim.max_upload_bytes
    )
    return _json(file_object(f))


@batch_bp.get("/files")
def list_files() -> Response:
    who = tenant()
    limit = _limit(10000, 10000)
    rows = services().files.list(
        who.id,
        purpose=request.args.get("purpose"),
        limit=limit + 1,
        after=request.args.get("after"),
    )
    data = [file_object(f) for f in rows[:limit]]
    return _json(
        {
            "object": "list",
            "data": data,
            "has_more": len(rows) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


@batch_bp.get("/files/<file_id>")
def retrieve_file(file_id: str) -> Response:
    who = tenant()
    f = services().files.get(who.id, file_id)
    return _json(file_object(f)) if f is not None else not_found("File", file_id)


@batch_bp.get("/files/<file_id>/content")
def file_content(file_id: str) -> Response:
    who = tenant()
    svc = services()
    f = svc.files.get(who.id, file_id)
    if f is None:
        return not_found("File", file_id)
    try:
        fh = svc.files.open(f)
    except OSError:
        return error(
            410,
            f"the content of {file_id} is no longer on disk",
            code="file_gone",
            type_="server_error",
        )

    def chunks() -> Any:
        with fh:
            while True:
                block = fh.read(1 << 16)
                if not block:
                    return
                yield block

    return Response(
        stream_with_context(chunks()),
        mimetype="application/octet-stream",
        headers={
            "Content-Length": str(f.bytes),
            "Content-Disposition": f'attachment; filename="{f.filename}"',
        },
    )


@batch_bp.delete("/files/<file_id>")
def delete_file(file_id: str) -> Response:
    who = tenant()
    try:
        deleted = services().files.delete(who.id, file_id)
    except TokenFleetError as exc:
        return error(409, str(exc), code="file_in_use")
    if not deleted:
        return not_found("File", file_id)
    return _json({"id": file_id, "object": "file", "deleted": True})


# ---- batches -------------------------------------------------------------------------
@batch_bp.post("/batches")
def create_batch() -> Response:
    who = tenant()
    body = _json_body()
    svc = services()
    b = jobs.create_batch(
        svc.engine,
        svc.files,
        jobs.Owner(who.id, who.allowed_models),
        input_file_id=body.get("input_file_id"),
        endpoint=body.get("endpoint"),
        completion_window=body.get("completion_window"),
        metadata=body.get("metadata"),
    )
    if svc.runner is not None:  # an idle runner polls slowly: start the lines now
        svc.runner.wake()
    return _json(jobs.batch_object(b))


@batch_bp.get("/batches")
def list_batches() -> Response:
    who = tenant()
    rows, more = jobs.list_batches(
        services().engine, who.id, limit=_limit(20, 100), after=request.args.get("after")
    )
    data = [jobs.batch_object(b) for b in rows]
    return _json(
        {
            "object": "list",
            "data": data,
            "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


@batch_bp.get("/batches/<batch_id>")
def retrieve_batch(batch_id: str) -> Response:
    who = tenant()
    b = jobs.get_batch(services().engine, who.id, batch_id)
    return _json(jobs.batch_object(b)) if b is not None else not_found("Batch", batch_id)


@batch_bp.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    who = tenant()
    svc = services()
    b = jobs.cancel_batch(svc.engine, who.id, batch_id)
    if b is None:
        return not_found("Batch", batch_id)
    if svc.runner is not None:  # wind its pending lines down now, not at the idle period
        svc.runner.wake()
    return _json(jobs.batch_object(b))


# ---- usage ---------------------------------------------------------------------------
@batch_bp.get("/usage")
def usage() -> Response:
    """The caller's quotas, what is left of them now, and flushed per-day usage."""
    who = tenant()
    svc = services()
    now: dict[str, Any] = {}
    for b in BUDGETS:
        limits = who.quotas.for_budget(b)
        st = svc.quotas.state(who.id, b, limits)
        now[b] = {
            "limits": limits.as_dict(),
            "requests_left": None if st.requests_left is None else int(st.requests_left),
            "tokens_left": None if st.tokens_left is None else int(st.tokens_left),
            "running": st.running,
            "daily_tokens_used": st.daily_tokens_used,
        }
    return _json(
        {"object": "usage", "tenant": who.id, "quotas": now, "daily": usage_for(svc.engine, who.id)}
    )
