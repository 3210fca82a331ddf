"""``llmd_flow_control``: llm-d / Gateway API Inference Extension flow control
(EXPERIMENTAL upstream: behind the EPP's ``flowControl`` feature gate).

llm-d does not run this by default. ``cmd/epp/runner/runner.go``
(``initAdmissionControl``) builds the flow controller only when the
``flowControl`` feature gate (``pkg/epp/flowcontrol/config.go``:
``FeatureGate = "flowControl"``) is on and logs "Experimental Flow Control
layer is disabled, using legacy admission control" otherwise; the shipped
default is ``llmd`` (``tokenfleet/core/admission/llmd.py``). This policy is
what an operator gets after turning the gate on, modelled on
kubernetes-sigs/gateway-api-inference-extension:

- Saturation detector
  (``pkg/epp/saturationdetector/framework/plugins/utilizationdetector/detector.go``,
  defaults in ``pkg/epp/saturationdetector/config.go``): each endpoint scores
  ``max(waiting / queueDepthThreshold, kv_usage / kvCacheUtilThreshold)``
  with defaults 5 and 0.8; an endpoint whose metrics are older than
  ``metricsStalenessThreshold`` (200 ms) scores 1.0; pool saturation is the
  unweighted mean of the endpoint scores.
- The detector is registered as a flow-control plugin
  (``cmd/epp/runner/register.go``, the "flow control" group) and handed to the
  flow controller as its ``SaturationDetector``; it is not in the default
  scheduling profile, so it does not filter endpoints per dispatch. The
  router sees every endpoint (``instance_ids=None``).
- ``pkg/epp/flowcontrol/controller/internal/processor.go`` (dispatchCycle):
  priority bands are served highest first, FCFS within a band (the default
  ``global-strict-fairness`` + ``fcfs-ordering`` policies); when saturation
  reaches the band's usage limit (1.0 by default) the cycle stops, so the
  head of the line blocks everything below it rather than invert priority.
- Dispatch rate: a cycle dispatches at most one request; cycles run on every
  enqueue and on a 1 ms ticker (``Run``), so we allow one queued dispatch per
  1 ms slot (``dispatch_tick_s``) besides the one an arrival may trigger.
- Shedding: ``FlowControlAdmissionController.Admit`` in
  ``pkg/epp/requestcontrol/admission.go`` rejects a sheddable request
  (priority < 0) at once while the pool is saturated; other bands wait in the
  gateway queue until the client gives up.

The saturation signal reads only scraped metrics, never the gateway's own
dispatch accounting, so between two scrapes it cannot see what it just
dispatched (the "thundering herd" the upstream README names as a trade-off).
Tier to band mapping: interactive 2, long_context 1, batch -1 (sheddable).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenfleet.core.admission.base import (
    ADMISSION,
    ADMIT,
    DISPATCH,
    QUEUE,
    REJECT,
    Action,
    AdmissionDecision,
    AdmissionSnapshot,
    BaseAdmission,
    InstanceLoad,
)
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import RequestInfo

DEFAULT_BANDS: dict[str, int] = {"interactive": 2, "long_context": 1, "batch": -1}


def endpoint_score(
    inst: InstanceLoad,
    now_s: float,
    queue_threshold: float,
    kv_threshold: float,
    staleness_s: float,
) -> float:
    m = inst.view.metrics
    if not m.healthy or now_s - m.scraped_at_s > staleness_s:
        return 1.0
    return max(m.num_waiting / queue_threshold, m.kv_usage / kv_threshold)


def pool_saturation(
    instances: Sequence[InstanceLoad],
    now_s: float,
    queue_threshold: float = 5.0,
    kv_threshold: float = 0.8,
    staleness_s: float = 0.2,
) -> float:
    """The utilization detector's ``Saturation``: mean endpoint score over the
    ready endpoints, 1.0 when there are none."""
    insts = [i for i in instances if i.view.ready]
    if not insts:
        return 1.0
    return sum(
        endpoint_score(i, now_s, queue_threshold, kv_threshold, staleness_s) for i in insts
    ) / len(insts)


class LlmdSaturationAdmission(BaseAdmission):
    """What both llm-d admissions share: the priority bands (a negative band is
    sheddable) and the utilization detector's pool saturation."""

    def __init__(
        self,
        *,
        slo: SLOConfig | None = None,
        bands: Mapping[str, int] | None = None,
        queue_depth_threshold: int = 5,
        kv_cache_util_threshold: float = 0.8,
        metrics_staleness_s: float = 0.2,
    ) -> None:
        if queue_depth_threshold < 1 or not 0 < kv_cache_util_threshold <= 1:
            raise ValueError("need queue_depth_threshold >= 1 and 0 < kv_cache_util_threshold <= 1")
        self.slo = slo or SLOConfig()
        self.bands = dict(bands or DEFAULT_BANDS)
        self.queue_threshold = float(queue_depth_threshold)
        self.kv_threshold = kv_cache_util_threshold
        self.staleness_s = metrics_staleness_s

    def sheddable(self, tier: str) -> bool:
        return self.bands.get(tier, 0) < 0

    def saturation(self, snap: AdmissionSnapshot) -> float:
        return pool_saturation(
            snap.instances, snap.now_s, self.queue_threshold, self.kv_threshold, self.staleness_s
        )


@ADMISSION.register("llmd_flow_control")
class LlmdFlowControlAdmission(LlmdSaturationAdmission):
    name = "llmd_flow_control"

    def __init__(
        self,
        *,
        slo: SLOConfig | None = None,
        bands: Mapping[str, int] | None = None,
        queue_depth_threshold: int = 5,
        kv_cache_util_threshold: float = 0.8,
        metrics_staleness_s: float = 0.2,
        headroom: float = 0.0,
        usage_limit: float = 1.0,
        dispatch_tick_s: float = 0.001,
    ) -> None:
        super().__init__(
            slo=slo,
            bands=bands,
            queue_depth_threshold=queue_depth_threshold,
            kv_cache_util_threshold=kv_cache_util_threshold,
            metrics_staleness_s=metrics_staleness_s,
        )
        # The detector's Filter headroom; kept for config compatibility, unused
        # here because the detector is not a scheduling filter by default.
        self.headroom = headroom
        self.usage_limit = usage_limit
        self._order = sorted(self.bands, key=lambda t: -self.bands[t])
        self.dispatch_tick_s = dispatch_tick_s
        self._last_slot = -1

    def on_arrival(self, request: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision:
        sat = self.saturation(snap)
        if sat >= self.usage_limit:
            if self.sheddable(request.tier):
                return AdmissionDecision(REJECT, reason=f"saturated ({sat:.2f}), sheddable band")
            return AdmissionDecision(QUEUE, reason=f"saturated ({sat:.2f})")
        if any(len(q) for q in snap.queues.values()):
            return AdmissionDecision(QUEUE, reason="gateway queue not empty")
        return AdmissionDecision(ADMIT, reason=f"sat {sat:.2f}")

    def next_action(self, snap: AdmissionSnapshot) -> Action | None:
        slot = int(snap.now_s / self.dispatch_tick_s)
        if slot <= self._last_slot:
            return None  # one dispatch cycle per ticker slot
        sat = self.saturation(snap)
        if sat >= self.usage_limit:
            return None  # head-of-line blocking across all bands
        for tier in sorted(snap.queues, key=lambda t: -self.bands.get(t, 0)):
            head = snap.queues[tier].head()
            if head is None:
                continue
            self._last_slot = slot
            return Action(DISPATCH, tier, head.request.request_id)
        return None

    def band_order(self) -> Sequence[str]:
        return tuple(self._order)
