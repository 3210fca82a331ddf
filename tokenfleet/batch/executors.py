"""How one batch line is executed: the seam between the batch runner and serving.

* :class:`GatewayExecutor` sends the line through the live request path
  in-process (``tokenfleet.live.gateway.Gateway``: SLOMax admission, router, Celery
  queue ``<dc>.batch``, worker, engine) with tier ``batch``. This is what the
  API process uses under ``tokenfleet up``.
* :class:`HttpExecutor` POSTs to any OpenAI-compatible base URL (an engine
  or emulator directly, or a remote TokenFleet API with a service key).

A result is *transient* (429, 503, connection trouble: the line goes back to
pending and is retried, up to the runner's attempt limit) or final (2xx ->
output file, other statuses -> error file with the response).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

TRANSIENT_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class LineResult:
    status_code: int
    body: dict[str, Any] | None
    request_id: str
    transient: bool = False
    retry_after_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


class LineExecutor(Protocol):
    def execute(
        self,
        tenant_id: str,
        body: dict[str, Any],
        *,
        request_id: str,
        slo_class: str | None = None,
        promoted: bool = False,
    ) -> LineResult: ...


def _usage(body: dict[str, Any] | None) -> tuple[int, int]:
    u = (body or {}).get("usage") or {}
    try:
        return int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    except (TypeError, ValueError):
        return 0, 0


def _error_body(message: str, type_: str = "server_error", code: Any = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class HttpExecutor:
    """POST ``{base_url}/chat/completions``; one ``requests`` session per thread."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        tier_header: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.tier_header = tier_header
        self._local = threading.local()

    def _session(self) -> Any:
        s = getattr(self._local, "session", None)
        if s is None:
            import requests

            s = requests.Session()
            self._local.session = s
        return s

    def execute(
        self,
        tenant_id: str,
        body: dict[str, Any],
        *,
        request_id: str,
        slo_class: str | None = None,
        promoted: bool = False,
    ) -> LineResult:
        import requests

        headers = {
            "Content-Type": "application/json",
            "X-Request-Id": request_id,
            "X-TokenFleet-Tenant": tenant_id,
        }
        if self.tier_header:
            headers["X-TokenFleet-Tier"] = "batch"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        payload = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            resp = self._session().post(
                self.base_url + "/chat/completions",
                json=payload,
                headers=headers,
                timeout=self.timeout_s,
            )
        except requests.RequestException as exc:
            return LineResult(
                503,
                _error_body(f"engine unreachable: {exc.__class__.__name__}"),
                request_id,
                transient=True,
                retry_after_s=1.0,
            )
        try:
            data = resp.json()
        except ValueError:
            data = _error_body(f"non-JSON response with status {resp.status_code}")
        if not isinstance(data, dict):
            data = _error_body("response is not a JSON object")
        retry = resp.headers.get("Retry-After")
        p, c = _usage(data)
        return LineResult(
            resp.status_code,
            data,
            resp.headers.get("X-Request-Id") or request_id,
            transient=resp.status_code in TRANSIENT_STATUSES,
            retry_after_s=float(retry) if retry and retry.isdigit() else None,
            prompt_tokens=p,
            completion_tokens=c,
        )


class GatewayExecutor:
    """Through the live path in this process (``tokenfleet.live.gateway.Gateway``),
    tier ``batch``."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway

    def execute(
        self,
        tenant_id: str,
        body: dict[str, Any],
        *,
        request_id: str,
        slo_class: str | None = None,
        promoted: bool = False,
    ) -> LineResult:
        from tokenfleet.live.gateway import GatewayError

        gw = self.gateway
        payload = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        try:
            req = gw.validate(payload, tenant=tenant_id, tier_hint="batch", slo_class=slo_class)
            d = gw.dispatch(req)
        except GatewayError as err:
            return LineResult(
                err.status,
                err.body(),
                request_id,
                transient=err.status in TRANSIENT_STATUSES,
                retry_after_s=err.retry_after_s,
            )
        rid = req.info.request_id
        parts: list[str] = []
        for ev in gw.events(d):
            if ev.kind == "d":
                parts.append(ev.text)
            elif ev.kind == "err":
                status = ev.code if ev.code >= 400 else 502
                return LineResult(
                    status,
                    _error_body(ev.message, ev.error_type or "server_error", ev.code),
                    rid,
                    transient=status in TRANSIENT_STATUSES and not parts,
                )
            elif ev.kind == "end":
                usage = ev.usage or {}
                out = {
                    "id": f"chatcmpl-{rid}",
                    "object": "chat.completion",
                    "created": req.created,
                    "model": req.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(parts)},
                            "logprobs": None,
                            "finish_reason": ev.finish_reason or "stop",
                        }
                    ],
                    "usage": usage,
                }
                p, c = _usage(out)
                return LineResult(200, out, rid, prompt_tokens=p, completion_tokens=c)
        return LineResult(
            502, _error_body("the request ended without an answer"), rid, transient=True
        )


class FunctionExecutor:
    """Wrap a plain function (tests, and embedding TokenFleet in another server)."""

    def __init__(self, fn: Any, delay_s: float = 0.0) -> None:
        self.fn = fn
        self.delay_s = delay_s

    def execute(
        self,
        tenant_id: str,
        body: dict[str, Any],
        *,
        request_id: str,
        slo_class: str | None = None,
        promoted: bool = False,
    ) -> LineResult:
        if self.delay_s:
            time.sleep(self.delay_s)
        result: LineResult = self.fn(tenant_id, body, request_id)
        return result
