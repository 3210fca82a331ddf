"""Admission policies: admit / queue / reject at arrival, dispatch order from
pooled per-tier queues, and the goodput feedback controller (docs/slomax.md).

Importing this package registers every built-in policy in ``ADMISSION``.
"""

from __future__ import annotations

from tokenfleet.core.admission.base import (
    ADMISSION,
    ADMIT,
    DISPATCH,
    DROP,
    QUEUE,
    REJECT,
    Action,
    Admission,
    AdmissionDecision,
    AdmissionSnapshot,
    BaseAdmission,
    InstanceLoad,
    QueuedRequest,
    QueueTotals,
    TierLoad,
    TierQueue,
    TierWindow,
    WindowStats,
    kv_reservation_tokens,
)

__all__ = [
    "ADMISSION",
    "ADMIT",
    "DISPATCH",
    "DROP",
    "QUEUE",
    "REJECT",
    "Action",
    "Admission",
    "AdmissionDecision",
    "AdmissionSnapshot",
    "BaseAdmission",
    "InstanceLoad",
    "QueuedRequest",
    "QueueTotals",
    "TierLoad",
    "TierQueue",
    "TierWindow",
    "WindowStats",
    "kv_reservation_tokens",
    "create_admission",
]


def create_admission(name: str, **kwargs: object) -> Admission:
    return ADMISSION.create(name, **kwargs)


def _load_builtins() -> None:
    # Imported for their registration side effect.
    from tokenfleet.core.admission import (  # noqa: F401
        fcfs,
        llmd,
        llmd_flow_control,
        slomax,
        strict_priority,
    )


_load_builtins()
