"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Types and codes follow the OpenAI API reference (error codes guide): 400
``invalid_request_error``, 401 ``invalid_api_key``, 404 ``model_not_found``,
429 ``rate_limit_exceeded``, 5xx ``server_error``. 429 and 503 carry a
``Retry-After`` header of at most 120 s.
"""

from __future__ import annotations

import json
import math
from typing import Any

from flask import Response

from tokenfleet.live.gateway.errors import GatewayError, error_type, openai_error_body

MAX_RETRY_AFTER_S = 120


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = error_type(status, type_)
        self.retry_after_s = retry_after_s

    @classmethod
    def from_gateway(cls, err: GatewayError) -> ApiError:
        """The response to a request the live path refused."""
        return cls(
            err.status,
            err.message,
            param=err.param,
            code=err.code,
            type_=err.type_,
            retry_after_s=err.retry_after_s,
        )

    def body(self) -> dict[str, Any]:
        return openai_error_body(
            self.status, self.message, param=self.param, code=self.code, type_=self.type
        )

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None and self.status not in (429, 503):
            return {}
        return {"Retry-After": str(retry_after_header(self.retry_after_s))}

    def response(self) -> Response:
        resp = Response(json.dumps(self.body()), status=self.status, mimetype="application/json")
        for k, v in self.headers().items():
            resp.headers[k] = v
        return resp


def retry_after_header(seconds: float | None) -> int:
    """Whole seconds, 1..120 (clients back off at least a second, at most two minutes)."""
    if seconds is None or not math.isfinite(seconds):
        return 1
    return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds))))
