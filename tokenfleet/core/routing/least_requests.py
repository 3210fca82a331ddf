"""Fewest in-flight requests, by this router's own dispatch accounting."""

from __future__ import annotations

from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.types import PoolSnapshot, RequestInfo, RouteDecision


@ROUTERS.register("least_requests")
class LeastRequestsRouter(BaseRouter):
    """Send each request to the instance with the fewest in-flight requests.

    The classic least-request balancer (Envoy ``LEAST_REQUEST``, SGLang's
    shortest-queue fallback in ``sgl-router/src/policies/cache_aware.rs``).
    Load is the router's own ``accounting.inflight_requests``: exact for this
    router, blind to other replicas, never stale. Ties are broken by scanning
    from a start index that rotates every call, so an idle pool is filled
    round-robin rather than always from instance 0.
    """

    name = "least_requests"

    def __init__(self, *, seed: int = 0) -> None:
        self._start = seed

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        candidates = eligible(request, pool)
        n = len(candidates)
        start = self._start % n
        self._start += 1
        best = candidates[start]
        best_load = best.accounting.inflight_requests
        for k in range(1, n):
            inst = candidates[(start + k) % n]
            load = inst.accounting.inflight_requests
            if load < best_load:
                best, best_load = inst, load
        return RouteDecision(instance_id=best.instance_id, reason=f"least_requests:{best_load}")
