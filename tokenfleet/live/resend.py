"""Where a request goes when its attempt cannot finish where it was sent.

One rule for both sides of the live path: the API re-sends a request whose
worker was lost (or whose instance's queue nobody consumes any more), a worker
re-sends a request its engine failed before the first token. Both call
:func:`pick_resend_target` on the instance views of the live state.

The rule: any other instance that is live, healthy, serves the request's model,
fits its prompt, was not tried before and sits in a datacenter the tenant may
use; the request's own datacenter first, then the instance with the fewest
requests in flight (the shared dispatch accounting), then the shortest engine
queue. A re-send goes to that instance's own queue: the point is to leave the
instance that failed, which the datacenter's pool queue would not promise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenfleet.live.jobs import ChatJob
from tokenfleet.live.queues import affinity_queue


@dataclass(frozen=True, slots=True)
class ResendTarget:
    instance_id: str
    dc: str
    queue: str


def resend_candidates(views: Iterable[Any], job: ChatJob, exclude: set[str]) -> list[Any]:
    """Instance views a re-send of ``job`` may go to (any order)."""
    out = []
    for v in views:
        if v.instance_id in exclude or not v.ready or not v.metrics.healthy:
            continue
        if v.model != job.model:
            continue
        if v.max_model_len_tokens and job.input_tokens + 1 > v.max_model_len_tokens:
            continue
        if job.allowed_dcs and v.dc not in job.allowed_dcs:
            continue
        out.append(v)
    return out


def pick_resend_target(
    views: Iterable[Any], job: ChatJob, exclude: set[str]
) -> ResendTarget | None:
    """The instance the next attempt of ``job`` goes to; None if there is none."""
    best: tuple[tuple[int, int, int], Any] | None = None
    for v in resend_candidates(views, job, exclude):
        key = (
            0 if v.dc == job.dc else 1,
            v.accounting.inflight_requests,
            v.metrics.num_running + v.metrics.num_waiting,
        )
        if best is None or key < best[0]:
            best = (key, v)
    if best is None:
        return None
    v = best[1]
    return ResendTarget(v.instance_id, v.dc, affinity_queue(v.dc, v.instance_id, job.tier))
