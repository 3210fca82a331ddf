"""The simulator's request record: what the router sees plus the hidden truth.

``TraceRequest.info`` is the only part any policy ever receives. The true
output length lives beside it, read by the simulated engine alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.core.types import RequestInfo


@dataclass(slots=True)
class TraceRequest:
    info: RequestInfo
    output_tokens: int  # true generated length: engine-only
    client_timeout_s: float | None = None  # client gives up (cancels) after this

    @property
    def arrival_s(self) -> float:
        return self.info.arrival_s
