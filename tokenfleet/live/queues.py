"""Queue names: one per (datacenter, tier), plus one per (instance, tier).

Names are computed, never looked up: the API publishes with ``routing_key ==
queue name`` on a direct exchange of the same name (Celery's default for a
queue it creates on demand, ``task_create_missing_queues``), so routing costs
one string format and no topic matching. ``<dc>.<tier>`` is the shared pool
queue of a datacenter (late binding: whichever worker frees first takes the
request); ``<dc>.<instance>.<tier>`` is the affinity queue of one instance,
used when the router expects a valuable prefix-cache hit there.
"""

from __future__ import annotations

from tokenfleet.core.types import TIERS

#: tier order = priority order: a worker consumes its queues in this order
TIER_PRIORITY: tuple[str, ...] = TIERS
#: queue of the control tasks run by beat (SLOMax tick, FleetMind cycle)
CONTROL_QUEUE = "tokenfleet.control"

#: each tier's share of an instance's slots until beat writes its own
#: (a worker's tier gate caps the tier at ``ceil(share * slots)`` running)
DEFAULT_SHARES: dict[str, float] = {"interactive": 1.0, "long_context": 1.0, "batch": 0.5}


def _check(part: str, what: str) -> str:
    if not part or "." in part or any(c.isspace() for c in part):
        raise ValueError(f"{what} '{part}' must be non-empty with no dots or spaces")
    return part


def pool_queue(dc: str, tier: str) -> str:
    return f"{_check(dc, 'datacenter')}.{_check(tier, 'tier')}"


def affinity_queue(dc: str, instance_id: str, tier: str) -> str:
    return f"{_check(dc, 'datacenter')}.{_check(instance_id, 'instance')}.{_check(tier, 'tier')}"


def worker_queues(
    dc: str, instance_id: str | None, tiers: tuple[str, ...] = TIER_PRIORITY, *, pool: bool = True
) -> list[str]:
    """Queues a worker consumes, highest priority first.

    For each tier the affinity queue comes before the pool queue, so work
    that was sent here for its cache is not overtaken by pool work of the
    same tier. A pool worker (no instance) consumes only pool queues; ``pool``
    False (a prefill-only instance) only its own.
    """
    out: list[str] = []
    for tier in tiers:
        if instance_id is not None:
            out.append(affinity_queue(dc, instance_id, tier))
        if pool or instance_id is None:
            out.append(pool_queue(dc, tier))
    return out


def tier_of_queue(queue: str) -> str:
    return queue.rsplit(".", 1)[-1]


def is_pool_queue(queue: str) -> bool:
    """``<dc>.<tier>`` (shared by a DC's workers), not ``<dc>.<instance>.<tier>``."""
    return queue.count(".") == 1 and tier_of_queue(queue) in TIER_PRIORITY
