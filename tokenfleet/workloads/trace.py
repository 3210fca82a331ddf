"""The simulator's request record: what the router sees plus the hidden truth.

``TraceRequest.info`` is the only part any policy ever receives. The true
output length, and for conversations the hashes of the answer's KV blocks,
live beside it, read by the simulated engine alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.core.types import RequestInfo


@dataclass(slots=True)
class TraceRequest:
    info: RequestInfo
    output_tokens: int  # true generated length: engine-only
    client_timeout_s: float | None = None  # client gives up (cancels) after this
    #: Full-block hashes of prompt + answer after the prompt's own blocks: the
    #: engine caches the answer's KV under them, and a conversation's next turn
    #: (prompt + answer + message) hits them. Engine-only, like output_tokens.
    output_block_hashes: tuple[int, ...] = ()

    @property
    def arrival_s(self) -> float:
        return self.info.arrival_s
