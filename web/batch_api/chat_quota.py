"""Quota admission around ``POST /v1/chat/completions`` (owned by web.routes).

Installed as app hooks so the chat view itself stays untouched:

* ``before_request``: authenticate with the tenancy directory (so a revoked
  key is refused within a second), check the model allow-list, and charge
  the tenant's budget (``interactive``, or ``batch`` for
  ``X-TokenFleet-Tier: batch`` / ``service_tier: "flex"``) atomically in
  Redis. Refusals are OpenAI-shaped 429s with ``code`` and Retry-After.
* ``after_request``: reconcile the reservation with the ``usage`` of the
  answer. For a stream the usage chunk is picked out of the event stream
  as it passes (present when the client asked ``include_usage``; without
  it the reservation stands) and the ticket is released when the server
  closes the response, even if the client went away.
* An error status means the request did not run: the full reservation is
  refunded.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

from flask import Flask, Response, g, request

from tokenfleet.tenancy.gate import Admission, TenancyError, estimate_chat_cost

CHAT_ENDPOINT = "openai.chat_completions"


def _budget(body: dict[str, Any]) -> str:
    if request.headers.get("X-TokenFleet-Tier", "") == "batch" or body.get("service_tier") == "flex":
        return "batch"
    return "interactive"


def _error_response(err: TenancyError) -> Response:
    resp = Response(json.dumps(err.body()), status=err.status, mimetype="application/json")
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp


def _usage_of(obj: Any) -> tuple[int, int] | None:
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    try:
        return int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    except (TypeError, ValueError):
        return None


class _UsageSniffer:
    """Pass SSE bytes through; remember the last ``usage`` seen in a data chunk.

    ``close()`` is forwarded to the wrapped iterable: the chat view notices a
    client that went away through its generator being closed.
    """

    def __init__(self, inner: Iterable[bytes]) -> None:
        self.inner = inner
        self.usage: tuple[int, int] | None = None
        self._tail = b""
        self._it: Iterator[bytes] | None = None

    def __iter__(self) -> Iterator[bytes]:
        self._it = iter(self.inner)
        return self

    def __next__(self) -> bytes:
        assert self._it is not None
        chunk = next(self._it)
        if b"usage" in chunk or self._tail:
            self._scan(chunk)
        return chunk

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def _scan(self, chunk: bytes) -> None:
        buf = self._tail + chunk
        events = buf.split(b"\n\n")
        self._tail = events.pop()[-65536:]
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"data: ") and b"usage" in line:
                    try:
                        u = _usage_of(json.loads(line[6:]))
                    except ValueError:
                        continue
                    if u is not None:
                        self.usage = u


def install_chat_quota(app: Flask) -> None:
    svc = app.extensions["tokenfleet.tenancy"]

    @app.before_request
    def _admit_chat() -> Response | None:
        if request.endpoint != CHAT_ENDPOINT:
            return None
        try:
            who = svc.authenticate(request.headers.get("Authorization"))
        except TenancyError as err:
            return _error_response(err)
        try:
            body = json.loads(request.get_data(cache=True) or b"null")
        except (ValueError, UnicodeDecodeError):
            return None  # the chat view answers malformed JSON itself
        if not isinstance(body, dict):
            return None
        model = body.get("model") if isinstance(body.get("model"), str) else None
        prompt, max_tokens = estimate_chat_cost(body)
        try:
            g.tf_admission = svc.gate.admit(who, _budget(body), model=model,
                                            prompt_tokens=prompt, max_tokens=max_tokens)
        except TenancyError as err:
            return _error_response(err)
        return None

    @app.after_request
    def _reconcile_chat(resp: Response) -> Response:
        adm: Admission | None = g.pop("tf_admission", None)
        if adm is None:
            return resp
        if resp.status_code >= 400:
            svc.gate.finish(adm, completion_tokens=0, prompt_tokens=0, ran=False)
            return resp
        if resp.is_streamed:
            sniffer = _UsageSniffer(resp.response)
            resp.response = sniffer

            def _close() -> None:
                if sniffer.usage is not None:
                    p, c = sniffer.usage
                    svc.gate.finish(adm, completion_tokens=c, prompt_tokens=p)
                else:  # no usage chunk: keep the whole reservation charged
                    svc.gate.finish(adm, completion_tokens=adm.ticket.reserved_tokens
                                    - adm.prompt_tokens)

            resp.call_on_close(_close)
            return resp
        try:
            usage = _usage_of(json.loads(resp.get_data()))
        except (ValueError, UnicodeDecodeError):
            usage = None
        if usage is not None:
            svc.gate.finish(adm, completion_tokens=usage[1], prompt_tokens=usage[0])
        else:
            svc.gate.finish(adm, completion_tokens=adm.ticket.reserved_tokens - adm.prompt_tokens)
        return resp

    @app.teardown_request
    def _release_on_crash(exc: BaseException | None) -> None:
        adm: Admission | None = g.pop("tf_admission", None)
        if adm is not None:  # after_request did not run: the request did not complete
            svc.gate.finish(adm, completion_tokens=0, prompt_tokens=0, ran=False)
