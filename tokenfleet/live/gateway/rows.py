"""The API's own copies of a request's final ledger row.

The worker writes a request's final row, but a worker killed before its
writer flushed (``kill -9``: up to ``flush_interval_s`` of rows in memory)
would leave the request ``in_flight`` and unbilled, and an end the API
decides itself (Redis lost, client gone) has no worker to write it. So the
API records every end it relays too: the worker's facts from the ``end``
entry (status, timestamps, usage), or the verdict of an error. Both copies
merge into one row by ``request_id`` under the writer's precedence rule
(:data:`tokenfleet.service.writer.STATUS_PRECEDENCE`), whichever lands first.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from tokenfleet.live.gateway.dispatch import Dispatched, ledger_record
from tokenfleet.live.gateway.validate import ChatRequest
from tokenfleet.live.relay import RelayEvent
from tokenfleet.live.state import LiveState
from tokenfleet.service.writer import RequestRecord

log = logging.getLogger("tokenfleet.api")


def _float(raw: str | None) -> float | None:
    try:
        return float(raw) if raw not in (None, "", "None") else None
    except ValueError:
        return None


def end_record(d: Dispatched, ev: RelayEvent, dc: str | None) -> RequestRecord | None:
    """The row the worker recorded for this ``end`` entry; None from a worker
    that does not send its ledger facts (an older version: its row stands alone)."""
    facts = ev.ledger or {}
    status = facts.get("s")
    if not status:
        return None
    usage: dict[str, Any] = ev.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    info = d.request.info
    return ledger_record(
        info,
        status,
        dc=dc,
        instance=ev.instance or None,
        dispatched_ts=_float(facts.get("td")),
        first_token_ts=_float(facts.get("tf")) or d.first_token_s,
        finished_ts=_float(facts.get("te")) or time.time(),
        prompt_tokens=int(usage.get("prompt_tokens") or info.input_tokens),
        cached_tokens=int(facts.get("ca") or details.get("cached_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or d.tokens),
        attempts=d.attempt,
    )


def error_record(d: Dispatched, ev: RelayEvent, dc: str | None = None) -> RequestRecord:
    """The row of a request that ended with an error event: the verdict the
    event carries (the API's own settlements), else ``timed_out`` for a 504
    and ``failed`` otherwise (the worker's, which records the same). Placed
    on the attempt that was serving (``d.serving``, in ``dc``), as the worker's
    row is: whichever copy lands first, the row says where it failed."""
    facts = ev.ledger or {}
    status = facts.get("s") or ("timed_out" if ev.code == 504 else "failed")
    return ledger_record(
        d.request.info,
        status,
        dc=dc,
        instance=d.serving or None,
        finished_ts=time.time(),
        first_token_ts=d.first_token_s,
        completion_tokens=d.tokens,
        attempts=d.attempt,
        error=(ev.message or status)[:500],
    )


def settled(status: str) -> dict[str, str]:
    """``RelayEvent.ledger`` of an error the API settled itself as ``status``."""
    return {"s": status}


#: refusals that are requests the service could not take (the client did
#: nothing wrong): recorded ``rejected``, so attainment counts them
REFUSAL_STATUSES = frozenset({429, 503})


def refusal_record(
    *,
    tenant: str,
    body: Any,
    req: ChatRequest | None,
    tier_hint: str,
    tiers: Mapping[str, Any],
    message: str,
) -> RequestRecord:
    """The ``rejected`` row of a request refused before it was dispatched; one
    refused before validation finished (Redis down) gets a fresh id and what
    its body says."""
    now = time.time()
    if req is not None:
        return ledger_record(req.info, "rejected", finished_ts=now, error=message[:500])
    model = body.get("model") if isinstance(body, dict) else None
    return RequestRecord(
        request_id=uuid.uuid4().hex,
        tenant_id=tenant,
        tier=tier_hint if tier_hint in tiers else "interactive",
        model=(model if isinstance(model, str) and model else "unknown")[:200],
        status="rejected",
        arrival_ts=now,
        finished_ts=now,
        prompt_tokens=0,
        error=message[:500],
    )


class PendingSettlements:
    """Ends the API decided while Redis was down, settled there once it is back.

    The API answered the client (an error, or the client left) and recorded
    the row; but until the request is ``done`` in Redis a worker may still
    claim a message of it that waited in the broker and run it again. A
    daemon thread retries ``finish`` + the cancel flag every ``period_s``
    until Redis answers, then exits (started again by the next :meth:`add`).
    """

    def __init__(self, state: LiveState, period_s: float = 0.5) -> None:
        self.state = state
        self.period_s = period_s
        self._pending: dict[str, str] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, request_id: str, status: str) -> None:
        with self._lock:
            self._pending[request_id] = status
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="tf-pending-settle", daemon=True
                )
                self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            with self._lock:
                todo = dict(self._pending)
            for rid, status in todo.items():
                try:
                    self.state.cancel(rid)
                    self.state.finish(rid, status)
                except Exception:  # noqa: BLE001 - still down: next period
                    break
                with self._lock:
                    self._pending.pop(rid, None)
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
