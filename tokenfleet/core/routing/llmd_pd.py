"""llm-d's P/D profile handler, re-implemented on our engines.

Sources (llm-d/llm-d-inference-scheduler): the ``pd-profile-handler`` and
its ``PrefixDisaggregationDecider``. The decode profile runs first and
picks a decode pod with the usual scorers (``llmd_weighted`` here, over the
decode pool); then, if the part of the prompt not cached on that pod is at
least the threshold,

    (1 - hit_percentage) * prompt_tokens >= non_cached_tokens

the prefill profile picks a prefill pod with its own scorers (a second
``llmd_weighted`` over the prefill pool) and the decode pod's sidecar runs
the prefill there first; otherwise the decode pod prefills locally. The
P/D split is the deployment's (``prefill_share``), fixed.
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
        hit = min(1.0, d.expected_cached_tokens / max(1, request.input_tokens))
        prefill = prefill_instances(request, pool)
        if (
            prefill
            and self.non_cached_tokens > 0
            and (1.0 - hit) * request.input_tokens >= self.non_cached_tokens
        ):
            p = self._prefill.route(request, sub_pool(pool, prefill))
            self._remote.add(request.request_id)
            return PDDecision(
                p.instance_id, d.instance_id, p.expected_cached_tokens, reason="llm-d: P/D"
            )
        return PDDecision(
            d.instance_id, None, d.expected_cached_tokens, reason="llm-d: decode only"
        )

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
