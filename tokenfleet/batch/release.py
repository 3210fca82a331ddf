"""Which batch lines to release into the batch tier now: a pure policy.

The batch tier gets ``normal_slots`` in-flight lines (SLOMax's batch share
of the fleet; it shrinks when interactive load returns), shared evenly among
batches with work left (water-filling), so one 50,000-line job cannot starve
a 10-line one.

Deadline awareness: a batch's *slack* is the time left before its
completion window closes minus the time its remaining lines need at the
observed per-line service time. When the slack falls below
``promote_margin`` times the work left (or below ``promote_min_slack_s``),
the batch is *promoted*: it is served first, earliest deadline first, and may
also use ``promoted_slots`` beyond the batch share. Promotion happens at
release because the live path has no priority inside a tier.

No I/O and no clock: the runner passes ``seconds_to_deadline`` in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchDemand:
    batch_id: str
    #: lines not finished yet (pending + in flight)
    remaining_lines: int
    #: lines of this batch in flight now
    inflight_lines: int
    seconds_to_deadline: float
    #: observed seconds one slot spends per line (service time)
    line_service_s: float


@dataclass(frozen=True, slots=True)
class ReleasePlan:
    #: batch id -> lines to release now
    grants: dict[str, int]
    promoted: frozenset[str]


def slack_s(d: BatchDemand, slots: int) -> float:
    """Time to spare if the batch had ``slots`` slots to itself."""
    needed = d.remaining_lines * d.line_service_s / max(1, slots)
    return d.seconds_to_deadline - needed


def is_promoted(
    d: BatchDemand, slots: int, *, promote_margin: float, promote_min_slack_s: float
) -> bool:
    needed = d.remaining_lines * d.line_service_s / max(1, slots)
    s = d.seconds_to_deadline - needed
    return s < promote_margin * needed or s < promote_min_slack_s


def plan_release(
    demands: list[BatchDemand],
    *,
    normal_slots: int,
    promoted_slots: int = 0,
    promote_margin: float = 0.5,
    promote_min_slack_s: float = 600.0,
) -> ReleasePlan:
    promoted = [
        d
        for d in demands
        if d.remaining_lines > d.inflight_lines
        and is_promoted(
            d, normal_slots, promote_margin=promote_margin, promote_min_slack_s=promote_min_slack_s
        )
    ]
    promoted_ids = frozenset(d.batch_id for d in promoted)
    grants: dict[str, int] = {}
    in_flight = sum(d.inflight_lines for d in demands)
    # promoted batches first, earliest deadline first, up to the extended capacity
    free = max(0, normal_slots + promoted_slots - in_flight)
    for d in sorted(promoted, key=lambda d: (d.seconds_to_deadline, d.batch_id)):
        want = d.remaining_lines - d.inflight_lines
        n = min(want, free)
        if n > 0:
            grants[d.batch_id] = n
            free -= n
    # the rest share what is left of the batch share evenly (water-filling)
    free = min(free, max(0, normal_slots - in_flight - sum(grants.values())))
    others = [
        d
        for d in demands
        if d.batch_id not in promoted_ids and d.remaining_lines > d.inflight_lines
    ]
    wanted = {d.batch_id: d.remaining_lines - d.inflight_lines for d in others}
    held = {d.batch_id: d.inflight_lines for d in others}
    while free > 0 and wanted:
        # give one slot to the batch holding the fewest, ties by id (deterministic)
        bid = min(wanted, key=lambda b: (held[b], b))
        grants[bid] = grants.get(bid, 0) + 1
        held[bid] += 1
        wanted[bid] -= 1
        free -= 1
        if wanted[bid] == 0:
            del wanted[bid]
    return ReleasePlan(grants=grants, promoted=promoted_ids)
