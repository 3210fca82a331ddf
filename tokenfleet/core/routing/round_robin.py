"""Round robin over the eligible instances."""

from __future__ import annotations

from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.types import PoolSnapshot, RequestInfo, RouteDecision


@ROUTERS.register("round_robin")
class RoundRobinRouter(BaseRouter):
    """Cycle through healthy workers with one shared counter.

    Mirrors SGLang's router (``sgl-router/src/policies/round_robin.rs``): a
    counter that advances on every request, taken modulo the number of
    healthy workers at that moment. No cache or load signal at all, which is
    what makes it the floor every other policy must beat.
    """

    name = "round_robin"

    def __init__(self, *, seed: int = 0) -> None:
        # The rotation is deterministic; ``seed`` only fixes the starting point
        # so several router replicas do not all start on instance 0.
        self._counter = seed

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        candidates = eligible(request, pool)
        inst = candidates[self._counter % len(candidates)]
        self._counter += 1
        return RouteDecision(instance_id=inst.instance_id, reason="round_robin")
