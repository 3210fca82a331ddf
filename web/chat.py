"""``POST /v1/chat/completions``: one request, read top to bottom.

authenticate -> parse the JSON body -> ``gateway.validate`` (the prompt is
tokenized once) -> charge the tenant's quota -> ``gateway.dispatch`` (Celery)
-> relay the events the worker writes to the request's stream, as one JSON
answer or as server-sent events -> reconcile the quota with the usage. The
worker writes the ledger row; nothing comes back up through this view but the
stream. Refusals are raised (``GatewayError``, ``TenancyError``, ``ApiError``)
and turned into OpenAI-shaped responses by ``web.create_app``'s handlers.

Each request holds a place in the process's in-flight bound from the moment
it is authenticated until its response ends (``gw.inflight``: over it, a 503
at once), and goes through the front gate for its CPU work up to the
dispatch (``gw.front_gate``: a few requests at a time, so that the threads
competing for the interpreter stay few and ``/health`` is answered at once;
one that cannot enter within ``api_front_wait_s`` gets a 503). A client that
closes its connection while the request waits for its answer (streamed or
not) cancels it: the wait asks the socket (:func:`web.server.client_gone`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Generator, Iterator
from typing import Any

from flask import Blueprint, Response, current_app, request

from tokenfleet.live.gateway import TIER_HEADER, Dispatched, Gateway
from tokenfleet.live.relay import RelayEvent
from web.errors import ApiError
from web.quota import ChatQuota
from web.server import client_gone

#: the status logged for a request whose client left before its answer (nginx's)
CLIENT_CLOSED = 499

chat_bp = Blueprint("openai", __name__, url_prefix="/v1")


def parse_json_body() -> Any:
    raw = request.get_data(cache=False)
    if not raw:
        raise ApiError(
            400,
            "We could not parse the JSON body of your request: the body is "
            "empty. Send a JSON object.",
            code="invalid_json",
        )
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(
            400,
            f"We could not parse the JSON body of your request ({exc}). Send valid JSON.",
            code="invalid_json",
        ) from None


@chat_bp.post("/chat/completions")
def chat_completions() -> Response:
    gw: Gateway = current_app.extensions["tokenfleet"]
    principal = current_app.extensions["tokenfleet.auth"].authenticate(
        request.headers.get("Authorization")
    )
    gw.inflight.enter()  # over the process's bound: 503 now, before any work
    try:
        return _chat(gw, principal)
    except BaseException:
        gw.inflight.leave()
        raise


def _chat(gw: Gateway, principal: Any) -> Response:
    """The request once it holds its place; the place is released when the
    response ends (by ``_sse`` or ``_never_ran`` for a stream, here otherwise).
    Its CPU work up to the dispatch runs through the front gate (a few at a
    time, the rest wait a bounded time or are refused)."""
    gw.front_gate.enter()
    try:
        body = parse_json_body()
        req = gw.validate(
            body,
            tenant=principal.tenant,
            slo_class=principal.slo_class,
            tier_hint=request.headers.get(TIER_HEADER, "") or "",
        )
        quota = ChatQuota.admit(current_app.extensions.get("tokenfleet.quota"), principal, req)
        try:
            d = gw.dispatch(req)
        except BaseException:
            quota.refund()
            raise
    finally:
        gw.front_gate.leave()
    gone = client_gone(request.environ)
    try:
        events = gw.events(d, client_gone=gone)
        if not req.stream:
            try:
                resp, usage = _complete(d, events)
            finally:
                events.close()
            if usage is None and resp.status_code == CLIENT_CLOSED:
                _disconnect(gw, "socket_eof")
                gw.cancel(d)
            quota.finish(usage)
            gw.inflight.leave()
            return resp
        # Hold the response until the first real event so an error before any
        # token still gets its proper HTTP status; after that, errors are events.
        first = next((ev for ev in events if ev.kind in ("d", "end", "err", "gone")), None)
        if first is not None and first.kind == "gone":
            _disconnect(gw, "socket_eof")
            events.close()
            gw.cancel(d)
            quota.finish(None)
            gw.inflight.leave()
            return Response(b"", status=CLIENT_CLOSED)
        if first is None or first.kind == "err":
            raise _event_error(first)
    except BaseException:
        quota.refund()
        raise
    return Response(
        _Stream(_sse(gw, d, first, events, quota), lambda: _never_ran(gw, d, events, quota)),
        mimetype="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Request-Id": req.info.request_id,
        },
    )


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


def _disconnect(gw: Gateway, how: str) -> None:
    if gw.metrics is not None:
        gw.metrics.disconnect(how)


class _Stream:
    """A streamed body whose clean-up runs even if the server never started it
    (a generator's ``finally`` runs only once it has started)."""

    def __init__(self, gen: Generator[bytes, None, None], never_ran: Any) -> None:
        self._gen = gen
        self._never_ran = never_ran
        self._started = False

    def __iter__(self) -> Iterator[bytes]:
        self._started = True
        return self._gen

    def close(self) -> None:
        self._gen.close()
        if not self._started:
            self._started = True
            self._never_ran()


def _never_ran(gw: Gateway, d: Dispatched, events: Iterator[RelayEvent], quota: ChatQuota) -> None:
    try:
        close = getattr(events, "close", None)
        if close is not None:
            close()
        gw.cancel(d)
        quota.finish(None)
    finally:
        gw.inflight.leave()


def _sse(
    gw: Gateway, d: Dispatched, first: RelayEvent, events: Iterator[RelayEvent], quota: ChatQuota
) -> Generator[bytes, None, None]:
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
            elif ev.kind == "gone":
                _disconnect(gw, "socket_eof")
                return  # the client left: cancelled below
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
    except GeneratorExit:
        _disconnect(gw, "write_failed")
        raise
    finally:
        try:
            if not finished:
                gw.cancel(d)
            quota.finish(usage)
        finally:
            gw.inflight.leave()  # whatever the clean-up raised: the place comes back


def _complete(
    d: Dispatched, events: Iterator[RelayEvent]
) -> tuple[Response, dict[str, Any] | None]:
    r = d.request
    parts: list[str] = []
    for ev in events:
        if ev.kind == "d":
            parts.append(ev.text)
        elif ev.kind == "gone":
            return Response(b"", status=CLIENT_CLOSED), None  # the caller cancels
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
