"""The tenant quota of one chat completion, called by the chat view.

:meth:`ChatQuota.admit` checks the tenant's model allow-list and charges its
budget (``interactive``, or ``batch`` for ``X-TokenFleet-Tier: batch`` /
``service_tier: "flex"``) atomically in Redis before the request is
dispatched; a refusal is a :class:`~tokenfleet.tenancy.gate.TenancyError`
(an OpenAI-shaped 429 with Retry-After, 404 or 400). When the request ends
the view calls :meth:`ChatQuota.finish` with the answer's usage (``None``:
the answer was cut off, the reservation stands) or :meth:`ChatQuota.refund`
(the request did not run).
"""

from __future__ import annotations

from typing import Any

from tokenfleet.live.gateway import ChatRequest
from tokenfleet.tenancy.gate import Admission
from web.auth import Principal


class ChatQuota:
    def __init__(self, gate: Any = None, admission: Admission | None = None) -> None:
        self.gate = gate
        self.admission = admission

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
        return cls(tenancy.gate, adm)

    def finish(self, usage: dict[str, Any] | None) -> None:
        """The request ran; reconcile the reservation with its ``usage``."""
        adm = self.admission
        if adm is None or self.gate is None:
            return
        if usage is None:  # no usage known: keep the whole reservation charged
            self.gate.finish(adm, completion_tokens=adm.ticket.reserved_tokens - adm.prompt_tokens)
            return
        try:
            prompt = int(usage.get("prompt_tokens") or 0)
            completion = int(usage.get("completion_tokens") or 0)
        except (TypeError, ValueError):
            self.finish(None)
            return
        self.gate.finish(adm, completion_tokens=completion, prompt_tokens=prompt)

    def refund(self) -> None:
        """The request did not run: give the whole reservation back."""
        if self.admission is not None and self.gate is not None:
            self.gate.finish(self.admission, completion_tokens=0, prompt_tokens=0, ran=False)
