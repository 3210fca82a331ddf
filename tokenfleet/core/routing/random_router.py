"""Uniform random choice among eligible instances."""

from __future__ import annotations

import random

from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.types import PoolSnapshot, RequestInfo, RouteDecision


@ROUTERS.register("random")
class RandomRouter(BaseRouter):
    """Pick a healthy worker uniformly at random.

    Mirrors SGLang's router (``sgl-router/src/policies/random.rs``) and
    Dynamo's ``--router-mode random``. Seeded, so simulations repeat.
    """

    name = "random"

    def __init__(self, *, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        candidates = eligible(request, pool)
        inst = self._rng.choice(candidates)
        return RouteDecision(instance_id=inst.instance_id, reason="random")
