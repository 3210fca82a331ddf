"""Why the gateway refuses a request: domain errors with what the client can do.

Each error knows the HTTP status and the OpenAI error ``code`` the API
answers with (the API is OpenAI-compatible, so these are part of the
contract), but nothing about Flask: ``web/`` turns them into responses,
the batch runner into output lines. :func:`openai_error_body` is the one
place that builds the ``{"error": {...}}`` object.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.errors import TokenFleetError

#: OpenAI error ``type`` by HTTP status (the OpenAI API reference, error codes guide)
DEFAULT_TYPE = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "requests",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


def error_type(status: int, type_: str | None = None) -> str:
    return type_ or DEFAULT_TYPE.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )


def openai_error_body(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type_: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type(status, type_),
            "param": param,
            "code": code,
        }
    }


class GatewayError(TokenFleetError):
    """A request the live path will not run; ``status``/``code`` say how the API answers."""

    status = 500
    code: str | None = None
    type_: str | None = None
    #: default Retry-After for this kind of refusal (None: no header unless 429/503)
    retry_after_s: float | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        return openai_error_body(
            self.status, self.message, param=self.param, code=self.code, type_=self.type_
        )


class InvalidRequest(GatewayError):
    """The request body is wrong: fix it and send it again."""

    status = 400


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(GatewayError):
    status = 404
    code = "model_not_found"
    type_ = "invalid_request_error"


class RegionNotAllowed(GatewayError):
    """The tenant's allowed regions exclude every datacenter serving the model."""

    status = 403
    code = "region_not_allowed"
    type_ = "invalid_request_error"


class AtCapacity(GatewayError):
    """Admission refused the request for its tier now; retry after the delay."""

    status = 429
    code = "rate_limit_exceeded"
    retry_after_s = 1.0


class NoCapacity(GatewayError):
    """No instance or datacenter can take the request now."""

    status = 503
    code = "no_capacity"
    retry_after_s = 2.0


class Overloaded(GatewayError):
    """This API process holds as many requests as it may; retry later or elsewhere."""

    status = 503
    code = "server_overloaded"
    retry_after_s = 1.0


class StoreUnavailable(GatewayError):
    """Redis (live state) or the message broker is down or restarting."""

    status = 503
    code = "service_unavailable"
    retry_after_s = 2.0


class ClientClosed(GatewayError):
    """The client closed its connection while its request waited to be admitted."""

    status = 499
    code = "client_closed_request"
    type_ = "invalid_request_error"


class HeldTooLong(GatewayError):
    """Admission held the request until the service's request timeout."""

    status = 504
    code = "timeout"
    type_ = "server_error"
