"""Per-request outcome records written by the simulator (and the live ledger)."""

from __future__ import annotations

from dataclasses import dataclass

#: Final statuses. Only "completed" requests that met their SLO are goodput.
STATUSES = ("completed", "failed", "cancelled", "timed_out", "rejected", "duplicate")


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    tenant: str
    tier: str
    arrival_s: float
    input_tokens: int
    max_tokens: int
    dc: str = ""
    instance_id: str = ""
    router_replica: int = 0
    dispatched_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    host_hit_tokens: int = 0  # of cached_tokens, loaded from the host-memory KV tier
    output_tokens: int = 0
    status: str = "pending"
    predicted_ttft_s: float | None = None
    deadline_s: float | None = None  # absolute
    wasted_gpu_s: float = 0.0  # work spent on a request that delivered nothing
    slo_met: bool = False

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        if self.finish_s is None:
            return None
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)
