"""The tenant quota of one chat completion, called by the chat view.

:meth:`ChatQuota.admit` checks the tenant's model allow-list and charges its
budget (``interactive``, or ``batch`` for ``X-TokenFleet-Tier: batch`` /
``service_tier: "flex"``) atomically in Redis before the request is
dispatched; a refusal is a :class:`~tokenfleet.tenancy.gate.TenancyError`
(an OpenAI-shaped 429 with Retry-After, 404 or 400). When the request ends
the view calls :meth:`ChatQuota.finish` with the answer's usage (``None``:
the answer was cut off, the reservation stands) or :meth:`ChatQuota.refund`
(the request did not run).

A key with limits of its own (``tokenfleet tenants keys create --rpm/--tpm``,
the admin UI) is charged too, after its tenant, as the subject
``<tenant>:key<id>``; a refusal there gives the tenant's charge back.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.live.gateway import ChatRequest
from tokenfleet.tenancy.gate import Admission, quota_error
from tokenfleet.tenancy.quota import QuotaLimits, Ticket
from web.auth import Principal


class ChatQuota:
    def __init__(
        self,
        gate: Any = None,
        admission: Admission | None = None,
        key_ticket: Ticket | None = None,
        key_limits: QuotaLimits | None = None,
    ) -> None:
        self.gate = gate
        self.admission = admission
        self.key_ticket = key_ticket
        self.key_limits = key_limits

    @classmethod
    def admit(cls, tenancy: Any, principal: Principal, req: ChatRequest) -> ChatQuota:
        """Charge ``req`` to the caller's budget; a no-op without tenancy (no database,
        or ``CHAT_QUOTAS`` off)."""
        if tenancy is None or principal.context is None:
            return cls()
        adm = tenancy.gate.admit(
            principal.context,
            req.budget,
            model=req.model,
            prompt_tokens=req.info.input_tokens,
            max_tokens=req.info.max_tokens,
        )
        ctx = principal.context
        if ctx.key_limits is None or ctx.key_id is None:
            return cls(tenancy.gate, adm)
        decision = tenancy.gate.quotas.admit(
            f"{ctx.id}:key{ctx.key_id}",
            req.budget,
            ctx.key_limits,
            prompt_tokens=req.info.input_tokens,
            max_tokens=req.info.max_tokens,
        )
        if not decision.allowed:
            tenancy.gate.finish(adm, completion_tokens=0, prompt_tokens=0, ran=False)
            err = quota_error(decision)
            err.message = f"API key {ctx.key_id} of tenant '{ctx.id}': {err.message}"
            raise err
        return cls(tenancy.gate, adm, decision.ticket, ctx.key_limits)

    def _release_key(self, actual_tokens: int) -> None:
        ticket, self.key_ticket = self.key_ticket, None
        if ticket is not None and self.gate is not None and self.key_limits is not None:
            self.gate.quotas.release(ticket, self.key_limits, actual_tokens=actual_tokens)

    def finish(self, usage: dict[str, Any] | None) -> None:
        """The request ran; reconcile the reservation with its ``usage``."""
        adm = self.admission
        if adm is None or self.gate is None:
            return
        if usage is None:  # no usage known: keep the whole reservation charged
            self._release_key(adm.ticket.reserved_tokens)
            self.gate.finish(adm, completion_tokens=adm.ticket.reserved_tokens - adm.prompt_tokens)
            return
        try:
            prompt = int(usage.get("prompt_tokens") or 0)
            completion = int(usage.get("completion_tokens") or 0)
        except (TypeError, ValueError):
            self.finish(None)
            return
        self._release_key(prompt + completion)
        self.gate.finish(adm, completion_tokens=completion, prompt_tokens=prompt)

    def refund(self) -> None:
        """The request did not run: give the whole reservation back."""
        if self.admission is not None and self.gate is not None:
            self._release_key(0)
            self.gate.finish(self.admission, completion_tokens=0, prompt_tokens=0, ran=False)
