"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one request, top to bottom.

authenticate -> parse the JSON body -> ``gateway.validate`` (the prompt is
tokenized once) -> charge the tenant's quota -> ``gateway.dispatch`` (Celery)
-> the request's events (``gateway.events``: the engine's tokens once the
worker handed the call over, then the worker's end entry), as one JSON answer
or as server-sent events -> reconcile the quota with the usage. The worker
writes the ledger row; nothing comes back up through this view but the events.
Refusals are raised (``GatewayError``, ``TenancyError``, ``ApiError``)
and turned into OpenAI-shaped responses by ``web.create_app``'s handlers; a
429 or 503 refusal also leaves a ``rejected`` ledger row (attainment counts
it), and every answer, errors included, carries ``X-Request-Id``.

The legacy completions API (a ``prompt`` string or token ids; what many tools
and vLLM's own benchmark send) takes the very same path; only the request's
prompt field and the answer's shape (:class:`_Shape`) differ.

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
from collections.abc import Callable, Generator, Iterator
from typing import Any

import redis
from flask import Blueprint, Response, current_app, g, request

from tokenfleet.live import steps
from tokenfleet.live.gateway import TIER_HEADER, ChatRequest, Dispatched, Gateway, HoldWait
from tokenfleet.live.gateway.rows import REFUSAL_STATUSES, refusal_record
from tokenfleet.live.relay import RelayEvent
from web.errors import ApiError
from web.limits import read_json
from web.quota import ChatQuota
from web.server import Restart, client_gone, pump_sink, response_restarter

#: the status logged for a request whose client left before its answer (nginx's)
CLIENT_CLOSED = 499

chat_bp = Blueprint("openai", __name__, url_prefix="/v1")


class _Shape:
    """How answers look: chat (``chat.completion``, deltas) or legacy completions
    (``text_completion``, ``text``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.chat = kind == "chat"
        self.prefix = "chatcmpl-" if self.chat else "cmpl-"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"

    def head(self, d: Dispatched) -> dict[str, Any]:
        r = d.request
        return {
            "id": self.prefix + r.info.request_id,
            "object": self.chunk_object,
            "created": r.created,
            "model": r.model,
        }

    def text_chunk(self, d: Dispatched, text: str) -> bytes:
        """:meth:`chunk` of a text delta, byte for byte, from the request's
        template: one string encode per chunk instead of a dict's."""
        before, after = self._template(d)
        return before + json.dumps(text).encode() + after

    def text_framer(self, d: Dispatched) -> Callable[[str], bytes]:
        """:meth:`text_chunk` for this request, holding its template only: the
        stream pump keeps it in ``d.sink``, and a framer that held ``d`` made
        every stream a reference cycle that only a full collection freed."""
        before, after = self._template(d)
        return lambda text: before + json.dumps(text).encode() + after

    def _template(self, d: Dispatched) -> tuple[bytes, bytes]:
        tpl: tuple[bytes, bytes] | None = d.extra.get("sse_template")
        if tpl is None:
            head = json.dumps(self.head(d))[:-1].encode()
            field = b'"delta": {"content": ' if self.chat else b'"text": '
            close = b"}" if self.chat else b""
            tpl = (
                b"data: " + head + b', "choices": [{"index": 0, ' + field,
                close + b', "logprobs": null, "finish_reason": null}]}\n\n',
            )
            d.extra["sse_template"] = tpl
        return tpl

    def chunk(
        self, d: Dispatched, text: str | None, finish: str | None = None, role: bool = False
    ) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta = {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=finish)
        obj = {**self.head(d), "choices": [choice]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def usage_chunk(self, d: Dispatched, usage: dict[str, Any] | None) -> bytes:
        obj = {**self.head(d), "choices": [], "usage": usage}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def whole(self, d: Dispatched, text: str, finish: str, usage: Any) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
            }
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish)
        return {**self.head(d), "object": self.object, "choices": [choice], "usage": usage}


#: ``/v1/completions`` without ``max_tokens``: 16, as OpenAI and ``vllm serve`` do
LEGACY_DEFAULT_MAX_TOKENS = 16

CHAT = _Shape("chat")
COMPLETION = _Shape("completion")


@chat_bp.post("/chat/completions")
def chat_completions() -> Response:
    return _serve(CHAT)


@chat_bp.post("/completions")
def completions() -> Response:
    """The legacy completions API: ``prompt`` (a string, or token ids), ``max_tokens``,
    ``stream`` (with ``stream_options.include_usage``); ``usage`` as for chat."""
    return _serve(COMPLETION)


def _serve(shape: _Shape) -> Response:
    steps.stamp("view")
    gw: Gateway = current_app.extensions["tokenfleet"]
    principal = current_app.extensions["tokenfleet.auth"].authenticate(
        request.headers.get("Authorization")
    )
    steps.stamp("authenticated")
    g.tf_tenant = principal.tenant  # for the metrics and the access log of a refusal
    tier_hint = request.headers.get(TIER_HEADER, "") or ""
    try:
        gw.inflight.enter()  # over the process's bound: 503 now, before any work
    except Exception as exc:  # refused unread: the row has no model, tier from the header
        _record_refusal(gw, principal.tenant, None, None, tier_hint, exc)
        raise
    gw.prefetch()  # what dispatch reads from Redis, while the body is parsed
    try:
        return _serve_held(gw, principal, shape, tier_hint)
    except BaseException:
        gw.inflight.leave()
        raise


def _serve_held(gw: Gateway, principal: Any, shape: _Shape, tier_hint: str) -> Response:
    """The request once it holds its place; the place is released when the
    response ends (by ``_sse`` or ``_never_ran`` for a stream, here otherwise).
    Its CPU work up to the dispatch runs through the front gate (a few at a
    time, the rest wait a bounded time or are refused)."""
    try:
        gw.front_gate.enter()
    except Exception as exc:
        _record_refusal(gw, principal.tenant, None, None, tier_hint, exc)
        raise
    in_gate = True  # admission may hold the request outside the gate (leave_gate)

    def leave_gate() -> None:
        nonlocal in_gate
        if in_gate:
            in_gate = False
            gw.front_gate.leave()

    gone = client_gone(request.environ)
    try:
        body = read_json()
        steps.stamp("body_read")
        if not shape.chat and isinstance(body, dict) and body.get("max_tokens") is None:
            # the legacy API's default output budget (OpenAI's and vLLM's), not chat's
            body["max_tokens"] = LEGACY_DEFAULT_MAX_TOKENS
        req: ChatRequest | None = None
        try:
            req = gw.validate(
                body,
                tenant=principal.tenant,
                slo_class=principal.slo_class,
                tier_hint=tier_hint,
                kind=shape.kind,
            )
            g.tf_tier = req.info.tier
            g.tf_request_id = req.info.request_id
            quota = ChatQuota.admit(current_app.extensions.get("tokenfleet.quota"), principal, req)
            steps.stamp("validated")
        except Exception as exc:
            _record_refusal(gw, principal.tenant, body, req, tier_hint, exc)
            raise
        try:
            d = gw.dispatch(req, HoldWait(leave_gate, gone))
            steps.stamp("dispatched")
        except BaseException as exc:
            quota.refund()
            if isinstance(exc, Exception):
                _record_refusal(gw, principal.tenant, body, req, tier_hint, exc)
            raise
        g.tf_dispatched = d
    finally:
        leave_gate()
    if gw.pump is not None:
        frame = shape.text_framer(d) if req.stream else None
        d.sink = pump_sink(request.environ, frame)
    try:
        events = gw.events(d, client_gone=gone)
        restart = response_restarter(request.environ) if req.stream else None
        if restart is not None:
            # returned before the first token: the response is set up while the
            # engine prefills, and an error before any token still gets its
            # own status (_deferred_sse replaces the head)
            return _stream_response(
                req,
                _deferred_sse(shape, gw, d, events, quota, restart, principal.tenant),
                lambda: _never_ran(gw, d, events, quota),
            )
        if not req.stream:
            try:
                resp, usage = _complete(shape, d, events)
            finally:
                events.close()
            if usage is None and resp.status_code == CLIENT_CLOSED:
                d.extra["outcome"] = "cancelled"
                _disconnect(gw, "socket_eof")
                gw.cancel(d)
            quota.finish(usage)
            gw.inflight.leave()
            return resp
        # Hold the response until the first real event so an error before any
        # token still gets its proper HTTP status; after that, errors are events.
        first = _first_event(events)
        steps.stamp("first_event")
        if first is not None and first.kind == "gone":
            _cancel_gone(gw, d, events, quota)
            gw.inflight.leave()
            return Response(b"", status=CLIENT_CLOSED)
        if first is None or first.kind == "err":
            raise _event_error(first)
    except BaseException:
        quota.refund()
        raise
    return _stream_response(
        req, _sse(shape, gw, d, first, events, quota), lambda: _never_ran(gw, d, events, quota)
    )


def _stream_response(
    req: ChatRequest, body: Generator[bytes, None, None], never_ran: Callable[[], None]
) -> Response:
    return Response(
        _Stream(body, never_ran),
        mimetype="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Request-Id": req.info.request_id,
        },
    )


def _deferred_sse(
    shape: _Shape,
    gw: Gateway,
    d: Dispatched,
    events: Iterator[RelayEvent],
    quota: ChatQuota,
    restart: Restart,
    tenant: str,
) -> Generator[bytes, None, None]:
    """A streamed answer returned before its first event (the server sends the
    head with the first body bytes): what the view would have done once the
    first event came, here. An error first replaces the head with its own
    status and OpenAI-shaped body; a client gone by then is cancelled."""
    # the role chunk that leaves with the first token, built while the engine prefills
    head = shape.chunk(d, None, role=True) if shape.chat else b""
    try:
        first = _first_event(events)
        steps.stamp("first_event")
    except BaseException:
        try:
            _close_events(events)
            quota.refund()
        finally:
            gw.inflight.leave()
        raise
    if first is not None and first.kind != "err" and first.kind != "gone":
        yield from _sse(shape, gw, d, first, events, quota, head)
        return
    try:
        if first is not None and first.kind == "gone":
            _cancel_gone(gw, d, events, quota)
            restart(
                CLIENT_CLOSED, {"Content-Length": "0", "X-Request-Id": d.request.info.request_id}
            )
            return
        _close_events(events)
        quota.refund()
        err = _event_error(first)
        if gw.metrics is not None:
            gw.metrics.error(err.status, tenant=tenant, tier=d.request.info.tier)
        body = json.dumps(err.body()).encode()
        restart(
            err.status,
            {
                "Content-Type": "application/json",
                "Content-Length": str(len(body)),
                "X-Request-Id": d.request.info.request_id,
                **err.headers(),
            },
        )
    finally:
        gw.inflight.leave()
    yield body


def _first_event(events: Iterator[RelayEvent]) -> RelayEvent | None:
    """The first event that decides the response: a token, the end, an error,
    or the client gone (None: the events ended without one)."""
    return next((ev for ev in events if ev.kind in ("d", "end", "err", "gone")), None)


def _cancel_gone(
    gw: Gateway, d: Dispatched, events: Iterator[RelayEvent], quota: ChatQuota
) -> None:
    """The client left before the first token: cancel the request."""
    d.extra["outcome"] = "cancelled"
    _disconnect(gw, "socket_eof")
    _close_events(events)
    gw.cancel(d)
    quota.finish(None)


def _close_events(events: Iterator[RelayEvent]) -> None:
    close = getattr(events, "close", None)
    if close is not None:
        close()


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
        _close_events(events)
        d.extra["outcome"] = "cancelled"
        gw.cancel(d)
        quota.finish(None)
    finally:
        gw.inflight.leave()


def _sse(
    shape: _Shape,
    gw: Gateway,
    d: Dispatched,
    first: RelayEvent,
    events: Iterator[RelayEvent],
    quota: ChatQuota,
    head: bytes | None = None,
) -> Generator[bytes, None, None]:
    r = d.request
    finished = False
    usage: dict[str, Any] | None = None
    try:
        if head is None:
            head = shape.chunk(d, None, role=True) if shape.chat else b""
        if first.kind == "d" and first.text:
            # the role chunk and the first token leave in one write
            yield head + shape.text_chunk(d, first.text)
            steps.stamp("first_written")
            steps.flush(r.info.request_id)
        else:
            if head:
                yield head
            events = itertools.chain([first], events)
        for ev in events:
            if ev.kind == "d":
                if ev.text:
                    yield shape.text_chunk(d, ev.text)
            elif ev.kind == "idle":
                yield b": keep-alive\n\n"
            elif ev.kind == "gone":
                _disconnect(gw, "socket_eof")
                return  # the client left: cancelled below
            elif ev.kind == "end":
                finished = True
                usage = ev.usage
                d.extra["usage"] = usage
                yield shape.chunk(d, None if shape.chat else "", ev.finish_reason or "stop")
                if r.include_usage:
                    yield shape.usage_chunk(d, ev.usage)
                yield b"data: [DONE]\n\n"
                return
            elif ev.kind == "err":
                finished = True
                d.extra["outcome"] = "error"
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
                d.extra["outcome"] = "cancelled"
                gw.cancel(d)
            quota.finish(usage)
        finally:
            gw.inflight.leave()  # whatever the clean-up raised: the place comes back


def _complete(
    shape: _Shape, d: Dispatched, events: Iterator[RelayEvent]
) -> tuple[Response, dict[str, Any] | None]:
    r = d.request
    parts: list[str] = []
    for ev in events:
        if ev.kind == "d":
            parts.append(ev.text)
        elif ev.kind == "gone":
            return Response(b"", status=CLIENT_CLOSED), None  # the caller cancels
        elif ev.kind == "err":
            d.extra["outcome"] = "error"
            raise _event_error(ev)
        elif ev.kind == "end":
            d.extra["usage"] = ev.usage
            body = shape.whole(d, "".join(parts), ev.finish_reason or "stop", ev.usage)
            resp = Response(
                json.dumps(body),
                mimetype="application/json",
                headers={"X-Request-Id": r.info.request_id},
            )
            return resp, ev.usage
    raise ApiError(502, "the request ended without an answer", code="server_error")
