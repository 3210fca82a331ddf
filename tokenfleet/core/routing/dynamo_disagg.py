"""NVIDIA Dynamo's conditional disaggregation, re-implemented on our engines.

Sources (ai-dynamo/dynamo): ``examples/llm/components/disagg_router.py``
(``PyDisaggregatedRouter.prefill_remote``) and the decode worker that calls
it, ``examples/llm/components/worker.py`` (queue size read from the NATS
prefill queue just before the decision). A request is first routed to a
decode worker by the KV router (``dynamo_kv`` here, over the decode pool);
that worker prefills remotely only when

    int(prompt_length * (1 - prefix_hit_rate)) > max_local_prefill_length  (1000)
    and prefill_queue_size < max_prefill_queue_size                         (2)

otherwise it prefills locally. Remote prefills go to a shared queue that
the prefill workers pull from one at a time, so the one free first takes
it: here the prefill instance with the fewest pending prefills (our
accounting stands in for the queue: pending prefills beyond one per worker
are "queued"). Newer Dynamo (``docs/design_docs/disagg_serving.md``, the
frontend's ``PrefillRouter``) sends every request through a prefill worker
when there is one, without this condition; the conditional version is the
one issue #22 names. The split of workers into prefill and decode is the
deployment's (``prefill_share``), fixed.
"""

from __future__ import annotations

from tokenfleet.core.routing.base import ROUTERS
from tokenfleet.core.routing.dynamo_kv import DynamoKVRouter
from tokenfleet.core.routing.pd_base import (
    PDDecision,
    PDRouter,
    decode_pool,
    prefill_instances,
)
from tokenfleet.core.types import (
    CompletionEvent,
    FirstTokenEvent,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
)
from tokenfleet.engine.kv_link import KVLink


@ROUTERS.register("dynamo_disagg")
class DynamoDisaggRouter(PDRouter):
    name = "dynamo_disagg"
    engines_publish_kv_events = True  # Dynamo's vLLM workers publish KV events

    def __init__(
        self,
        *,
        max_local_prefill_length: int = 1000,
        max_prefill_queue_size: int = 2,
        prefill_share: float = 0.5,
        link: KVLink | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(link=link, prefill_share=prefill_share)
        self.max_local_prefill_length = max_local_prefill_length
        self.max_prefill_queue_size = max_prefill_queue_size
        self._decode_router = DynamoKVRouter(seed=seed)

    def route_pd(self, request: RequestInfo, pool: PoolSnapshot) -> PDDecision:
        d = self._decode_router.route(request, decode_pool(request, pool))
        uncached = request.input_tokens - d.expected_cached_tokens
        prefill = prefill_instances(request, pool)
        queued = sum(max(0, i.accounting.prefill_pending_requests - 1) for i in prefill)
        if (
            prefill
            and uncached > self.max_local_prefill_length
            and queued < self.max_prefill_queue_size
        ):
            p = min(prefill, key=lambda i: (i.accounting.prefill_pending_requests, i.index))
            return PDDecision(p.instance_id, d.instance_id, 0, reason="dynamo: remote prefill")
        return PDDecision(
            d.instance_id, None, d.expected_cached_tokens, reason="dynamo: local prefill"
        )

    def on_first_token(self, event: FirstTokenEvent) -> None:
        self._decode_router.on_first_token(event)

    def on_complete(self, event: CompletionEvent) -> None:
        self._decode_router.on_complete(event)

    def on_kv_event(self, event: KVEvent) -> None:
        self._decode_router.on_kv_event(event)
