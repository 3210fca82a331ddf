"""What the policies learn from a request: its first token and its end.

The router, admission (SLOMax) and FleetMind each get the first token (TTFT
against their prediction) and the completion (output tokens, cache hit) of
every request this API dispatched. Late binding may run a request elsewhere
than the router chose; :meth:`Feedback._rebind` corrects what a cache-aware
router believes about both instances' caches. The API's metrics are fed here
too.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tokenfleet.core.tiers import SLOConfig, meets_slo
from tokenfleet.core.types import CompletionEvent, FirstTokenEvent, KVEvent
from tokenfleet.live.gateway.dispatch import Dispatched
from tokenfleet.live.relay import RelayEvent


class Feedback:
    """Part of :class:`~tokenfleet.live.gateway.Gateway`: policy feedback."""

    router: Any
    router_lock: threading.Lock
    admission: Any
    dc_selector: Any
    index: Any
    index_lock: threading.Lock
    metrics: Any
    slo: SLOConfig

    def first_token_feedback(self, d: Dispatched) -> None:
        """Run the first token's feedback (router, admission, FleetMind, metrics)
        if it is still due; every end of a request calls it first."""
        actual, d.first_token_due = d.first_token_due, None
        if actual is None:
            return
        if actual != d.instance:
            self._rebind(d, actual)
        self._on_first_token(d, actual)

    def _settle_dc_choice(self, d: Dispatched, status: str) -> None:
        self.first_token_feedback(d)
        if d.dc_ticket is None or self.dc_selector is None:
            return
        with self.router_lock:
            self.dc_selector.finished(d.dc_ticket, d.request.info, status, d.tokens)

    def _rebind(self, d: Dispatched, actual: str) -> None:
        """Late binding put the request elsewhere than the router chose: correct
        what the router believes about both caches (a cache-aware router records
        its own choice as the new holder of this prefix)."""
        hashes = d.request.info.block_hashes
        if not hashes:
            return
        with self.index_lock:
            known = self.index.match_instance(d.instance, hashes)
        events = [KVEvent(actual, "stored", hashes, exact=False)]
        if known < len(hashes):
            events.append(KVEvent(d.instance, "removed", tuple(hashes[known:]), exact=False))
        with self.router_lock:
            for ev in events:
                self.router.on_kv_event(ev)
        d.instance = actual

    def _on_first_token(self, d: Dispatched, instance: str) -> None:
        assert d.first_token_s is not None
        pred = d.decision.predicted_ttft_s if d.decision else None
        ev = FirstTokenEvent(
            request=d.request.info,
            instance_id=instance,
            now_s=d.first_token_s,
            ttft_s=d.first_token_s - d.dispatch_s,
            predicted_ttft_s=pred,
        )
        with self.router_lock:
            self.router.on_first_token(ev)
            if self.admission is not None:
                self.admission.on_first_token(ev)
            if d.dc_ticket is not None and self.dc_selector is not None:
                self.dc_selector.first_token(d.dc_ticket, d.request.info, ev.ttft_s)
        if self.metrics is not None:
            self.metrics.first_token(
                d.request.info.tier, d.first_token_s - d.request.info.arrival_s
            )

    def _on_complete(self, d: Dispatched, ev: RelayEvent) -> None:
        self.first_token_feedback(d)
        now = time.time()
        usage = ev.usage or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        done = CompletionEvent(
            request=d.request.info,
            instance_id=ev.instance or d.instance,
            now_s=now,
            status="completed",
            output_tokens=int(usage.get("completion_tokens", 0)),
            cached_tokens=cached,
            ttft_s=(d.first_token_s - d.dispatch_s) if d.first_token_s else None,
            e2e_s=now - d.request.info.arrival_s,
        )
        with self.router_lock:
            self.router.on_complete(done)
            if self.admission is not None:
                self.admission.on_complete(done)
            if d.dc_ticket is not None and self.dc_selector is not None:
                self.dc_selector.finished(
                    d.dc_ticket, d.request.info, "completed", done.output_tokens
                )
        info = d.request.info
        out = int(usage.get("completion_tokens", 0))
        # the SLO as the API saw it (the worker's ledger row applies the same rule):
        # the metrics' status and the access log's outcome
        first = d.first_token_s if d.first_token_s is not None else now
        met = meets_slo(
            self.slo.slo_for(info.tier),
            status="completed",
            input_tokens=int(usage.get("prompt_tokens", info.input_tokens)),
            ttft_s=first - info.arrival_s,
            tpot_s=(now - first) / (out - 1) if out > 1 else None,
            e2e_s=now - info.arrival_s,
            deadline_in_s=info.deadline_s - info.arrival_s if info.deadline_s is not None else None,
        )
        status = "completed" if met else "slo_missed"
        d.extra["outcome"] = status
        if self.metrics is not None:
            self.metrics.finished(info.tier, status, out, tenant=info.tenant)
