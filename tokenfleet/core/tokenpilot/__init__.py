"""Building blocks of the TokenPilot router (``tokenfleet.core.routing.tokenpilot``).

Kept apart from the router so each estimator can be tested on its own and
reused by other policies (admission, autoscaling) without importing a router.
"""

from __future__ import annotations

from tokenfleet.core.tokenpilot.cache import PrefixKnowledge
from tokenfleet.core.tokenpilot.estimators import (
    LogRatioCorrector,
    OutputLengthModel,
    PrefillModel,
    StepInflation,
)
from tokenfleet.core.tokenpilot.tiers import HostTierKnowledge

__all__ = [
    "HostTierKnowledge",
    "LogRatioCorrector",
    "OutputLengthModel",
    "PrefillModel",
    "PrefixKnowledge",
    "StepInflation",
]
