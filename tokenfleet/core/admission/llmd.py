"""``llmd``: llm-d's shipped admission, the EPP's legacy admission controller.

What an llm-d / Gateway API Inference Extension endpoint picker does by
default (kubernetes-sigs/gateway-api-inference-extension):

- ``cmd/epp/runner/runner.go`` (``initAdmissionControl``): unless the
  experimental ``flowControl`` feature gate is on (``FeatureGate =
  "flowControl"`` in ``pkg/epp/flowcontrol/config.go``) the EPP builds
  ``NewLegacyAdmissionController(saturationDetector, endpointCandidates)``.
- ``pkg/epp/requestcontrol/admission.go`` (``LegacyAdmissionController.Admit``,
  ``rejectIfSheddableAndSaturated``): a *sheddable* request (priority < 0) is
  rejected with ResourceExhausted when the saturation detector reports
  ``Saturation >= 1.0``; every other request bypasses the check and goes
  straight to scheduling. There is no gateway queue: admission is a binary
  admit/reject at arrival.
- The saturation detector (``pkg/epp/saturationdetector/framework/plugins/
  utilizationdetector/detector.go``, defaults in
  ``pkg/epp/saturationdetector/config.go``) is the pool mean of
  ``max(waiting / 5, kv_usage / 0.8)`` per endpoint, 1.0 for an endpoint whose
  metrics are older than 200 ms. It is registered as a detector
  (``cmd/epp/runner/register.go``) and is not in the default scheduling
  profile, so it never restricts which endpoint the scheduler picks:
  admitted requests may go to any endpoint (``instance_ids=None``).

Priority comes from the request's InferenceObjective; the tier to priority
mapping is the same as ``llmd_flow_control``'s bands: interactive 2,
long_context 1, batch -1 (the sheddable one).
"""

from __future__ import annotations

from tokenfleet.core.admission.base import (
    ADMISSION,
    ADMIT,
    REJECT,
    AdmissionDecision,
    AdmissionSnapshot,
)
from tokenfleet.core.admission.llmd_flow_control import LlmdSaturationAdmission
from tokenfleet.core.types import RequestInfo


@ADMISSION.register("llmd")
class LlmdLegacyAdmission(LlmdSaturationAdmission):
    name = "llmd"

    def on_arrival(self, request: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision:
        if not self.sheddable(request.tier):
            # non-sheddable requests bypass the saturation check entirely
            return AdmissionDecision(ADMIT, reason="non-sheddable")
        sat = self.saturation(snap)
        if sat >= 1.0:
            return AdmissionDecision(REJECT, reason=f"saturated ({sat:.2f}), sheddable")
        return AdmissionDecision(ADMIT, reason=f"sheddable, sat {sat:.2f}")

    def uses_queues(self) -> bool:
        return False
