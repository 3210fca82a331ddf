"""The tenant quota of one chat completion, called by the chat view.

:meth:`ChatQuota.admit` checks the tenant's model allow-list and charges its
budget (``interactive``, or ``batch`` for ``X-TokenFleet-Tier: batch`` /
``service_tier: "flex"``) atomically in Redis before the request is
dispatched; a refusal is a :class:`~tokenfleet.tenancy.gate.TenancyError`
(an OpenAI-shaped 429 with Retry-After, 404 or 400). When the request ends
the view calls :meth:`ChatQuota.finish` with the answer's usage (``None``:
the answer was cut off, the reservation stands) or :meth:`ChatQuota.refund`
(the request did not run).

A request without ``max_tokens`` does not reserve the gateway's whole default
(4,096) against a small budget: it reserves at most what the tokens-per-minute
bucket and the daily budget have left after the prompt (at least
:data:`MIN_IMPLICIT_RESERVE` tokens, never more than the budget can ever
grant), and the completion's real usage is trued up when it ends (the
quota's release charges any excess). Refusals of such a request say that the
reservation was implicit and how to set ``max_tokens``.

A key with limits of its own (``tokenfleet tenants keys create --rpm/--tpm``,
the admin UI) is charged too, after its tenant, as the subject
``<tenant>:key<id>``; a refusal there gives the tenant's charge back.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.live.gateway import ChatRequest
from tokenfleet.tenancy.gate import Admission, TenancyError, quota_error
from tokenfleet.tenancy.quota import CODE_DAILY, CODE_TOO_LARGE, CODE_TPM, QuotaLimits, Ticket
from web.auth import Principal

#: the smallest implicit reservation: a request never waits for less than this
MIN_IMPLICIT_RESERVE = 16


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
        ctx = principal.context
        prompt = req.info.input_tokens
        reserve = req.info.max_tokens
        if req.max_tokens_implicit:
            limits = ctx.quotas.for_budget(req.budget)
            reserve = implicit_reservation(
                lambda: tenancy.quotas.state(ctx.id, req.budget, limits), limits, prompt, reserve
            )
        try:
            adm = tenancy.gate.admit(
                ctx, req.budget, model=req.model, prompt_tokens=prompt, max_tokens=reserve
            )
        except TenancyError as err:
            if req.max_tokens_implicit and err.code in (CODE_TPM, CODE_DAILY, CODE_TOO_LARGE):
                err.message += (
                    f". This request set no max_tokens, so {reserve} tokens were reserved for "
                    f"its answer on top of its {prompt}-token prompt; set max_tokens (or "
                    "max_completion_tokens) to the longest answer you need to reserve less"
                )
            raise
        if ctx.key_limits is None or ctx.key_id is None:
            return cls(tenancy.gate, adm)
        decision = tenancy.gate.quotas.admit(
            f"{ctx.id}:key{ctx.key_id}",
            req.budget,
            ctx.key_limits,
            prompt_tokens=prompt,
            max_tokens=reserve,
        )
        if not decision.allowed:
            tenancy.gate.finish(adm, completion_tokens=0, prompt_tokens=0, ran=False)
            refusal = quota_error(decision)
            refusal.message = f"API key {ctx.key_id} of tenant '{ctx.id}': {refusal.message}"
            raise refusal
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


def implicit_reservation(state: Any, limits: QuotaLimits, prompt: int, default: int) -> int:
    """Output tokens to reserve for a request that set no ``max_tokens``.

    ``default`` (the gateway's, bounded by the context left) capped by what the
    token budgets have left after the prompt, read with ``state()`` (one Redis
    round trip, only for budgets with token limits). At least
    :data:`MIN_IMPLICIT_RESERVE`, so an empty bucket makes the request wait a
    little (429 with Retry-After) rather than be admitted for nothing; never more
    than a full budget minus the prompt, so it is not refused as too large.
    """
    tpm, daily = limits.tokens_per_minute, limits.daily_token_budget
    if tpm is None and daily is None:
        return default
    st = state()
    reserve = default
    if tpm is not None:
        left = int(st.tokens_left or 0) - prompt
        reserve = min(reserve, max(MIN_IMPLICIT_RESERVE, left), max(1, tpm - prompt))
    if daily is not None:
        left = daily - int(st.daily_tokens_used) - prompt
        reserve = min(reserve, max(MIN_IMPLICIT_RESERVE, left), max(1, daily - prompt))
    return max(1, reserve)
