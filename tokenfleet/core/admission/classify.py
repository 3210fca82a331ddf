"""Tier classification for admission, from what is known at arrival.

Extends ``tokenfleet.core.tiers.classify`` (input length, task type, the
tenant's ``slo_class == "batch"``) with the two remaining signals the
gateway has:

- the output budget: a request allowed ``long_output_min_tokens`` or more
  output tokens holds KV and a seat as long as a long prompt does, so it is
  treated as long_context (``None`` disables the rule);
- a tenant SLO class that names a tier: a tenant declared ``interactive``
  gets interactive treatment unless the prompt is long, since no chat TTFT
  limit can absorb a long prefill.

Order: explicit valid tier > batch endpoint or batch SLO class > long input >
long output budget > tenant SLO class naming a tier > interactive.
"""

from __future__ import annotations

from tokenfleet.core.tiers import SLOConfig, classify
from tokenfleet.core.types import RequestInfo

#: Output budget from which a request counts as long_context.
LONG_OUTPUT_MIN_TOKENS = 16384


def classify_request(request: RequestInfo, slo: SLOConfig,
                     long_output_min_tokens: int | None = LONG_OUTPUT_MIN_TOKENS) -> str:
    base = classify(request, slo)
    if request.tier in slo.tiers or base != "interactive":
        return base
    if long_output_min_tokens is not None and request.max_tokens >= long_output_min_tokens \
            and "long_context" in slo.tiers:
        return "long_context"
    if request.slo_class and request.slo_class in slo.tiers:
        return request.slo_class
    return base
