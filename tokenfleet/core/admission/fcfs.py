"""``fcfs``: the baseline. One FIFO, no admission control.

Every request is admitted on arrival and routed at once, so the only queues
are the engines' own FCFS waiting queues. This is exactly the driver's
behaviour without any admission layer, and a test checks that it is.
"""

from __future__ import annotations

from tokenfleet.core.admission.base import (
    ADMISSION,
    ADMIT,
    AdmissionDecision,
    AdmissionSnapshot,
    BaseAdmission,
)
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import RequestInfo


@ADMISSION.register("fcfs")
class FCFSAdmission(BaseAdmission):
    name = "fcfs"

    def __init__(self, *, slo: SLOConfig | None = None) -> None:
        self.slo = slo

    def on_arrival(self, request: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision:
        return AdmissionDecision(ADMIT, reason="fcfs")

    def uses_queues(self) -> bool:
        return False
