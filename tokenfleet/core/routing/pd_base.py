"""Prefill/decode disaggregation: the decision type and the P/D router base.

A P/D router answers, per request, where to prefill and where to decode
(the same instance: aggregated). Like every router it is a pure function of
the request and the snapshot; the driver (simulator or live service) runs
the two phases. Instance roles (``InstanceView.role``) say what each
instance accepts: "prefill" only remote prefills, "decode" decodes and
short local prefills, "mixed" anything. ``plan_roles`` lets a router resize
the pools on a long cycle; the driver applies what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfleet.core.routing.base import BaseRouter, eligible
from tokenfleet.core.types import InstanceView, PoolSnapshot, RequestInfo, RouteDecision
from tokenfleet.engine.kv_link import KVLink

PREFILL = "prefill"
DECODE = "decode"
MIXED = "mixed"
ROLES = (PREFILL, DECODE, MIXED)


@dataclass(frozen=True, slots=True)
class PDDecision:
    """Where each phase runs; ``decode_instance_id`` None or equal: aggregated."""

    prefill_instance_id: str
    decode_instance_id: str | None = None
    expected_cached_tokens: int = 0  # on the prefill instance
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    reason: str = ""

    @property
    def disaggregated(self) -> bool:
        return (
            self.decode_instance_id is not None
            and self.decode_instance_id != self.prefill_instance_id
        )


def static_roles(n_instances: int, prefill_share: float) -> list[str]:
    """The first ``round(n * share)`` instances prefill, the rest decode (at
    least one of each when n >= 2): a fixed P/D deployment."""
    if n_instances < 2:
        return [MIXED] * n_instances
    n_p = min(n_instances - 1, max(1, round(n_instances * prefill_share)))
    return [PREFILL] * n_p + [DECODE] * (n_instances - n_p)


def with_role(instances: Sequence[InstanceView], *roles: str) -> list[InstanceView]:
    return [i for i in instances if i.role in roles]


def split(instances: Sequence[InstanceView]) -> bool:
    """The pool has prefill or decode instances (it is not all mixed). Only a
    split pool's roles replace an admission layer's instance subset (SLOMax's
    lane and per-tier split): an all-mixed pool has no prefill pool for the
    subset to hide."""
    return bool(with_role(instances, PREFILL, DECODE))


class PDRouter(BaseRouter):
    """Base of disaggregating routers: ``route_pd`` decides both phases."""

    name = "pd"
    #: the simulator runs this router in a P/D pool (tokenfleet.sim.pd)
    disaggregating = True

    def __init__(self, *, link: KVLink | None = None, prefill_share: float = 0.5) -> None:
        self.link = link or KVLink()
        self.prefill_share = prefill_share

    def route_pd(self, request: RequestInfo, pool: PoolSnapshot) -> PDDecision:
        raise NotImplementedError

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        """Aggregated fallback for a driver that cannot run two phases."""
        d = self.route_pd(request, pool)
        inst = d.decode_instance_id if d.disaggregated else d.prefill_instance_id
        assert inst is not None
        return RouteDecision(inst, 0 if d.disaggregated else d.expected_cached_tokens)

    def initial_roles(self, n_instances: int) -> list[str]:
        return static_roles(n_instances, self.prefill_share)

    def plan_roles(self, pool: PoolSnapshot) -> list[str] | None:
        """New roles, one per instance in ``pool`` order, or None to keep them."""
        return None

    def on_prefill_done(self, request: RequestInfo, instance_id: str, now_s: float) -> None:
        """The prefill half of a disaggregated request ended on ``instance_id``
        (the response carrying ``kv_transfer_params`` came back)."""
        return None


def candidates(request: RequestInfo, pool: PoolSnapshot, *roles: str) -> list[InstanceView]:
    """Eligible instances with one of ``roles`` (all eligible ones if none has)."""
    ok = eligible(request, pool)
    picked = with_role(ok, *roles)
    return picked or ok


def sub_pool(pool: PoolSnapshot, instances: Sequence[InstanceView]) -> PoolSnapshot:
    """``pool`` narrowed to ``instances``, for a peer's inner (one-phase) router."""
    return PoolSnapshot(pool.now_s, list(instances), pool.router_id)


def decode_pool(request: RequestInfo, pool: PoolSnapshot) -> PoolSnapshot:
    """Where a fixed-split peer decodes: decode and mixed instances."""
    return sub_pool(pool, candidates(request, pool, DECODE, MIXED))


def prefill_instances(request: RequestInfo, pool: PoolSnapshot) -> list[InstanceView]:
    """The eligible prefill-only instances (none: the peer prefills locally)."""
    return with_role(eligible(request, pool), PREFILL)
