"""``strict_priority``: per-tier queues, higher tiers always dispatched first.

No rejection and no per-tier caps: a request waits in its tier's queue until
some instance has room, and room always goes to the highest non-empty tier
(interactive, then long_context, then batch). "Room" uses the driver's exact
accounting, so it cannot be fooled by stale scrapes: fewer than
``max_pending_per_instance`` requests still waiting for their first token,
a free seat, and KV for prompt + ``max_tokens``.

It shows what ordering alone buys, and what it costs: under overload the
lowest tier starves, and nothing is turned away early.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.core.admission.base import (
    ADMISSION,
    ADMIT,
    DISPATCH,
    QUEUE,
    Action,
    AdmissionDecision,
    AdmissionSnapshot,
    BaseAdmission,
    InstanceLoad,
    kv_reservation_tokens,
)
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import TIERS, RequestInfo


def instances_with_room(
    request: RequestInfo,
    instances: Sequence[InstanceLoad],
    max_pending: int,
    kv_budget: float = 1.0,
) -> tuple[str, ...]:
    """Instances that can start this request soon without evicting anything."""
    need = kv_reservation_tokens(request)
    out = []
    for inst in instances:
        view = inst.view
        if not (view.ready and view.metrics.healthy):
            continue
        if inst.prefill_pending >= max_pending:
            continue
        if inst.inflight >= view.profile.max_num_seqs:
            continue
        if inst.kv_free_tokens(kv_budget) < need:
            continue
        out.append(view.instance_id)
    return tuple(out)


@ADMISSION.register("strict_priority")
class StrictPriorityAdmission(BaseAdmission):
    name = "strict_priority"

    def __init__(
        self,
        *,
        slo: SLOConfig | None = None,
        max_pending_per_instance: int = 2,
        order: Sequence[str] = TIERS,
    ) -> None:
        if max_pending_per_instance < 1:
            raise ValueError("max_pending_per_instance must be >= 1")
        self.slo = slo or SLOConfig()
        self.max_pending = max_pending_per_instance
        self.order = tuple(order)

    def _rank(self, tier: str) -> int:
        return self.order.index(tier) if tier in self.order else len(self.order)

    def on_arrival(self, request: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision:
        rank = self._rank(request.tier)
        # Anything of equal or higher priority already waiting goes first.
        if any(snap.queued(t) for t in self.order[: rank + 1]):
            return AdmissionDecision(QUEUE, reason="behind queued work of equal or higher tier")
        room = instances_with_room(request, snap.instances, self.max_pending)
        if room:
            return AdmissionDecision(ADMIT, instance_ids=room, reason="room")
        return AdmissionDecision(QUEUE, reason="no instance has room")

    def next_action(self, snap: AdmissionSnapshot) -> Action | None:
        for tier in self.order:
            q = snap.queues.get(tier)
            if q is None:
                continue
            head = q.head()
            if head is None:
                continue
            room = instances_with_room(head.request, snap.instances, self.max_pending)
            if room:
                return Action(DISPATCH, tier, head.request.request_id, instance_ids=room)
            # Strict: a blocked higher tier blocks everything below it.
            return None
        return None
