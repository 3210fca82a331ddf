"""llm-d's P/D profile handler, re-implemented on our engines.

Sources (llm-d/llm-d-inference-scheduler): ``pkg/plugins/profile/
pd_profile_handler.go`` (``Pick``: the decode profile runs first; the
decider then says whether the prefill profile runs too) and
``pkg/plugins/profile/prefix_based_pd_decider.go`` (``decide``). The decode
profile picks a decode pod with the usual scorers (``llmd_weighted`` here,
over the decode pool); the prefix-based decider then disaggregates when

    nonCachedTokens <= 0                                  (always)
    or (prompt_tokens >= nonCachedTokens
        and prompt_tokens - hit_tokens_on_that_decode_pod >= nonCachedTokens)

and the prefill profile picks a prefill pod with its own scorers (a second
``llmd_weighted`` over the prefill pool); the decode pod's sidecar runs the
prefill there first. Otherwise the decode pod prefills locally. llm-d's
shipped P/D guide (llm-d/llm-d ``guides/pd-disaggregation/scheduler/
pd-disaggregation.values.yaml``) deploys ``always-disagg-pd-decider``, i.e.
threshold 0; we default to 1000 so short chat prompts stay local (measured
against 0 in docs/benchmarks.md section 13). The P/D split is the
deployment's (``prefill_share``), fixed.
"""

from __future__ import annotations

from tokenfleet.core.routing.base import ROUTERS
from tokenfleet.core.routing.llmd_weighted import LlmdWeightedRouter
from tokenfleet.core.routing.pd_base import (
    PDDecision,
    PDRouter,
    decode_pool,
    prefill_instances,
    sub_pool,
)
from tokenfleet.core.types import (
    CompletionEvent,
    FirstTokenEvent,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
)
from tokenfleet.engine.kv_link import KVLink


@ROUTERS.register("llmd_pd")
class LlmdPDRouter(PDRouter):
    name = "llmd_pd"

    def __init__(
        self,
        *,
        non_cached_tokens: int = 1000,
        prefill_share: float = 0.5,
        link: KVLink | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(link=link, prefill_share=prefill_share)
        self.non_cached_tokens = non_cached_tokens
        self._decode = LlmdWeightedRouter(seed=seed)
        self._prefill = LlmdWeightedRouter(seed=seed + 1)
        self._remote: set[str] = set()

    def route_pd(self, request: RequestInfo, pool: PoolSnapshot) -> PDDecision:
        d = self._decode.route(request, decode_pool(request, pool))
        prefill = prefill_instances(request, pool)
        if prefill and self._decide(request.input_tokens, d.expected_cached_tokens):
            p = self._prefill.route(request, sub_pool(pool, prefill))
            self._remote.add(request.request_id)
            return PDDecision(
                p.instance_id, d.instance_id, p.expected_cached_tokens, reason="llm-d: P/D"
            )
        return PDDecision(
            d.instance_id, None, d.expected_cached_tokens, reason="llm-d: decode only"
        )

    def _decide(self, prompt_tokens: int, hit_tokens: int) -> bool:
        """``PrefixBasedPDDecider.decide``: run the prefill profile or not."""
        t = self.non_cached_tokens
        if t <= 0:
            return True
        return prompt_tokens >= t and prompt_tokens - hit_tokens >= t

    def on_prefill_done(self, request: RequestInfo, instance_id: str, now_s: float) -> None:
        self._prefill.on_first_token(FirstTokenEvent(request, instance_id, now_s, 0.0))
        self._prefill.on_complete(
            CompletionEvent(request, instance_id, now_s, "completed", 1, 0, None, 0.0)
        )
        self._remote.discard(request.request_id)

    def on_first_token(self, event: FirstTokenEvent) -> None:
        self._decode.on_first_token(event)

    def on_complete(self, event: CompletionEvent) -> None:
        self._decode.on_complete(event)
        self._remote.discard(event.request.request_id)

    def on_kv_event(self, event: KVEvent) -> None:
        self._decode.on_kv_event(event)
        self._prefill.on_kv_event(event)
