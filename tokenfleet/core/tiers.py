"""Tier classification and per-tier SLOs.

A request's tier decides which SLO it is judged against and which queue it
waits in. Classification only uses what is known at arrival: input length,
output budget, task type and the tenant's declared SLO class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.core.types import TIERS, RequestInfo
from tokenfleet.errors import ValidationError


@dataclass(frozen=True, slots=True)
class TierSLO:
    """Limits a request of this tier must meet to count towards goodput.

    The TTFT limit may scale with input length (long prompts need time to
    prefill): ``ttft_s + ttft_per_1k_input_s * input_tokens / 1000``.
    """

    ttft_s: float | None = None
    ttft_per_1k_input_s: float = 0.0
    tpot_s: float | None = None
    deadline_s: float | None = None  # relative to arrival, if the request has none
    client_timeout_s: float | None = None  # client cancels after this (simulator)

    def ttft_limit_s(self, input_tokens: int) -> float | None:
        if self.ttft_s is None:
            return None
        return self.ttft_s + self.ttft_per_1k_input_s * input_tokens / 1000.0


DEFAULT_SLOS: dict[str, TierSLO] = {
    # Chat: a first token within a second and reading-speed streaming.
    "interactive": TierSLO(ttft_s=1.0, tpot_s=0.10),
    # Long prompts: 1 s plus 0.1 s per 1k input tokens (about 3x an unloaded
    # 8B/H200 prefill), streaming slightly slower than chat is acceptable.
    "long_context": TierSLO(ttft_s=1.0, ttft_per_1k_input_s=0.10, tpot_s=0.15),
    # Offline work: done within an hour unless the request carries a deadline.
    "batch": TierSLO(deadline_s=3600.0),
}


@dataclass(frozen=True, slots=True)
class SLOConfig:
    tiers: Mapping[str, TierSLO] = field(default_factory=lambda: dict(DEFAULT_SLOS))
    long_context_min_input_tokens: int = 8192
    # An output budget this large holds KV and a seat as long as a long prompt
    # does, so it is long_context too (None disables the rule).
    long_output_min_tokens: int | None = 16384

    def slo_for(self, tier: str) -> TierSLO:
        return self.tiers.get(tier, self.tiers.get("interactive", TierSLO()))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<slo>") -> SLOConfig:
        tiers = dict(DEFAULT_SLOS)
        raw = data.get("tiers", {})
        if not isinstance(raw, Mapping):
            raise ValidationError(source, "tiers", "must be a mapping of tier name to limits")
        allowed = set(TierSLO.__slots__)
        for name, limits in raw.items():
            if not isinstance(limits, Mapping):
                raise ValidationError(source, f"tiers.{name}", "must be a mapping")
            bad = set(limits) - allowed
            if bad:
                raise ValidationError(
                    source,
                    f"tiers.{name}.{sorted(bad)[0]}",
                    f"unknown limit; use one of {sorted(allowed)}",
                )
            for k, v in limits.items():
                if v is not None and (not isinstance(v, (int, float)) or v < 0):
                    raise ValidationError(
                        source, f"tiers.{name}.{k}", "must be a non-negative number"
                    )
            values: dict[str, Any] = {
                k: (float(v) if v is not None else None) for k, v in limits.items()
            }
            tiers[str(name)] = TierSLO(**values)
        thr = data.get("long_context_min_input_tokens", 8192)
        if not isinstance(thr, int) or thr < 1:
            raise ValidationError(
                source, "long_context_min_input_tokens", "must be a positive integer"
            )
        out_thr = data.get("long_output_min_tokens", 16384)
        if out_thr is not None and (not isinstance(out_thr, int) or out_thr < 1):
            raise ValidationError(
                source, "long_output_min_tokens", "must be a positive integer or null"
            )
        return cls(tiers=tiers, long_context_min_input_tokens=thr, long_output_min_tokens=out_thr)


def classify(request: RequestInfo, slo: SLOConfig) -> str:
    """Tier from what is known at arrival.

    Order: explicit valid tier > batch endpoint or batch SLO class > long
    input > long output budget > a tenant SLO class naming a tier >
    interactive. A tenant declared ``interactive`` still gets long_context for
    a long prompt, since no chat TTFT limit can absorb a long prefill.
    """
    if request.tier in slo.tiers:
        return request.tier
    if request.task_type == "batch" or request.slo_class == "batch":
        return "batch"
    if request.input_tokens >= slo.long_context_min_input_tokens:
        return "long_context"
    if (
        slo.long_output_min_tokens is not None
        and request.max_tokens >= slo.long_output_min_tokens
        and "long_context" in slo.tiers
    ):
        return "long_context"
    if request.slo_class and request.slo_class in slo.tiers:
        return request.slo_class
    return "interactive"


__all__ = ["TIERS", "TierSLO", "SLOConfig", "DEFAULT_SLOS", "classify", "meets_slo"]


def meets_slo(
    slo: TierSLO,
    *,
    status: str,
    input_tokens: int,
    ttft_s: float | None,
    tpot_s: float | None,
    e2e_s: float | None,
    deadline_in_s: float | None = None,
) -> bool:
    """The strict goodput rule: completed *and* within every limit of its tier.

    ``deadline_in_s`` is the request's own relative deadline, if it has one;
    it overrides the tier default.
    """
    if status != "completed":
        return False
    limit = slo.ttft_limit_s(input_tokens)
    if limit is not None and (ttft_s is None or ttft_s > limit):
        return False
    if slo.tpot_s is not None and tpot_s is not None and tpot_s > slo.tpot_s:
        return False
    deadline = deadline_in_s if deadline_in_s is not None else slo.deadline_s
    return not (deadline is not None and (e2e_s is None or e2e_s > deadline))
