"""The tenancy checks of the request path, in the order a request meets them.

The API authenticates the key (``web.auth``, the one authenticator) ->
``admit`` (model allowed? quota?) -> the request runs -> ``finish`` (reconcile
the token reservation, free the concurrency slot, record usage). The chat
endpoint and the batch runner both go through this object; failures come back
as :class:`TenancyError` carrying the HTTP status, OpenAI ``type``/``code`` and
headers of the error response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenfleet.errors import TokenFleetError
from tokenfleet.tenancy.directory import TenantContext, TenantDirectory
from tokenfleet.tenancy.quota import QuotaDecision, QuotaEnforcer, Ticket
from tokenfleet.tenancy.usage import UsageRecorder


class TenancyError(TokenFleetError):
    """An API-facing refusal: status, OpenAI error fields and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def quota_error(decision: QuotaDecision) -> TenancyError:
    if decision.retry_after_s is None:  # can never pass: retrying is pointless
        return TenancyError(
            400 if decision.code == "request_exceeds_quota" else 429,
            decision.message(),
            type_="invalid_request_error"
            if decision.code == "request_exceeds_quota"
            else "rate_limit_error",
            code=decision.code,
            param=decision.limit_name,
        )
    return TenancyError(
        429,
        decision.message(),
        type_="rate_limit_error",
        code=decision.code,
        param=decision.limit_name,
        headers=decision.retry_after_header(),
    )


@dataclass(slots=True)
class Admission:
    tenant: TenantContext
    ticket: Ticket
    prompt_tokens: int
    done: bool = field(default=False)


class TenancyGate:
    def __init__(
        self, directory: TenantDirectory, quotas: QuotaEnforcer, usage: UsageRecorder | None = None
    ) -> None:
        self.directory = directory
        self.quotas = quotas
        self.usage = usage

    def admit(
        self,
        tenant: TenantContext,
        budget: str,
        *,
        model: str | None,
        prompt_tokens: int,
        max_tokens: int,
        ticket_id: str | None = None,
    ) -> Admission:
        if model is not None and not tenant.allows_model(model):
            raise TenancyError(
                404,
                f"model '{model}' is not available to tenant '{tenant.id}'; allowed: "
                f"{', '.join(tenant.allowed_models)}",
                type_="invalid_request_error",
                code="model_not_found",
                param="model",
            )
        decision = self.quotas.admit(
            tenant.id,
            budget,
            tenant.quotas.for_budget(budget),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            ticket_id=ticket_id,
        )
        if not decision.allowed:
            if self.usage is not None:
                self.usage.record(tenant.id, budget, rejected=1)
            raise quota_error(decision)
        assert decision.ticket is not None
        return Admission(tenant, decision.ticket, prompt_tokens)

    def finish(
        self,
        admission: Admission,
        *,
        completion_tokens: int,
        prompt_tokens: int | None = None,
        ran: bool = True,
    ) -> None:
        """Reconcile with real usage; idempotent, so call it in a ``finally``.

        ``ran=False``: the request was never served (error before the engine,
        retryable refusal): its reservation is refunded and it is not counted
        as a request in the usage table.
        """
        if admission.done:
            return
        admission.done = True
        prompt = admission.prompt_tokens if prompt_tokens is None else prompt_tokens
        limits = admission.tenant.quotas.for_budget(admission.ticket.budget)
        self.quotas.release(admission.ticket, limits, actual_tokens=prompt + completion_tokens)
        if self.usage is not None and ran:
            self.usage.record(
                admission.tenant.id,
                admission.ticket.budget,
                requests=1,
                prompt_tokens=prompt,
                completion_tokens=completion_tokens,
            )


#: output reservation when a request sets no max_tokens (the gateway's own default)
DEFAULT_MAX_TOKENS = 4096


def estimate_chat_cost(body: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, reserved output tokens) of a chat request, before it runs.

    The prompt is counted like the gateway does (rendered chat, 4 bytes per
    token, ``tokenfleet.tokenizer``); the output reservation is
    ``max_completion_tokens``/``max_tokens`` or :data:`DEFAULT_MAX_TOKENS`.
    Both are reconciled with real usage when the request finishes.
    """
    from tokenfleet.tokenizer import BYTES_PER_TOKEN, encode_text, render_chat

    try:
        prompt = len(encode_text(render_chat(body.get("messages") or []))) // BYTES_PER_TOKEN
    except (ValueError, TypeError, AttributeError):
        prompt = 0
    out = body.get("max_completion_tokens")
    if out is None:
        out = body.get("max_tokens")
    if not isinstance(out, int) or isinstance(out, bool) or out < 0:
        out = DEFAULT_MAX_TOKENS
    return prompt, out
