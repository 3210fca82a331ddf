"""An attempt's verdict and counters, the same wherever it ran.

A worker settles the attempts it claimed (``workers/tasks.py``); the API
settles the ones it runs itself (express dispatch,
:mod:`tokenfleet.live.gateway.watch`). Both call these, so the ledger row,
the ``end`` entry and beat's counters cannot drift apart between the paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet.core.tiers import SLOConfig, meets_slo
from tokenfleet.live.jobs import ChatJob
from tokenfleet.live.relay import RelayWriter


def first_token_counts(
    slo: SLOConfig, tier: str, input_tokens: int, arrival_ts: float, first_ts: float | None
) -> dict[str, int]:
    """Beat's controller reads first tokens within the TTFT limit per tier: a
    faster signal than finished requests (the simulator feeds it the same)."""
    limit = slo.slo_for(tier).ttft_limit_s(input_tokens)
    met = first_ts is not None and (limit is None or first_ts - arrival_ts <= limit)
    return {f"first_tokens_{tier}": 1, f"ttft_met_{tier}": int(met)}


@dataclass(slots=True)
class Completed:
    """An attempt whose engine answered to the end."""

    status: str  # "completed" or "slo_missed"
    ok: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    first_ts: float
    finished_ts: float
    #: the relay stream's ``end`` entry, with the ledger facts the API copies
    end: dict[str, Any]

    def counts(self, tier: str) -> dict[str, int]:
        """The winner's counters for beat."""
        return {
            f"finished_{tier}": 1,
            f"slo_met_{tier}": int(self.ok),
            "completion_tokens": self.completion_tokens,
        }


def completed(
    slo: SLOConfig,
    job: ChatJob,
    relay: RelayWriter,
    *,
    first_ts: float | None,
    finished_ts: float,
    dispatched_ts: float,
    usage: dict[str, Any] | None,
    tokens: int,
    finish_reason: str,
) -> Completed:
    """Judge a finished attempt against its tier's SLO (the engine's usage when
    it sent one, else what was counted) and build its ``end`` entry."""
    completion = int((usage or {}).get("completion_tokens", tokens))
    cached = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    prompt = int((usage or {}).get("prompt_tokens", job.input_tokens))
    first = finished_ts if first_ts is None else first_ts  # zero tokens: first = end
    tpot = (finished_ts - first) / (completion - 1) if completion > 1 else None
    ok = meets_slo(
        slo.slo_for(job.tier),
        status="completed",
        input_tokens=prompt,
        ttft_s=first - job.arrival_ts,
        tpot_s=tpot,
        e2e_s=finished_ts - job.arrival_ts,
        deadline_in_s=job.deadline_ts - job.arrival_ts if job.deadline_ts else None,
    )
    status = "completed" if ok else "slo_missed"
    end = relay.end_fields(
        finish_reason,
        usage
        or {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    )
    # what the ledger row says, for the API's copy of it: a worker killed
    # before its writer flushed must not leave the request unbilled
    end.update({"s": status, "td": dispatched_ts, "tf": first, "te": finished_ts, "ca": cached})
    return Completed(status, ok, prompt, completion, cached, first, finished_ts, end)
