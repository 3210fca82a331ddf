"""FleetMind: cross-datacenter capacity coordination.

The datacenter is chosen first (a selector from ``FLEET``), then that DC's
own router picks the instance. ``topology`` describes the sites, ``residency``
holds the hard filters every selector is confined to, ``state`` the
snapshot a selector sees, ``planner`` the long cycle. See docs/fleetmind.md.
"""

from __future__ import annotations

from tokenfleet.core.fleet.planner import (
    DCStats,
    Plan,
    PlanAction,
    Planner,
    PlannerInput,
    PoolStats,
    RollbackEvent,
)
from tokenfleet.core.fleet.policies import (
    FLEET,
    BaseSelector,
    DCSelector,
    FleetMind,
    PolicyContractError,
    SkyLB,
    candidates_for,
    select_dc,
)
from tokenfleet.core.fleet.residency import compliant, data_region, may_cross_region
from tokenfleet.core.fleet.state import (
    DCDecision,
    DCView,
    FleetCompletion,
    FleetFirstToken,
    FleetSnapshot,
    PoolAccounting,
    PoolCosts,
    PoolView,
)
from tokenfleet.core.fleet.topology import (
    Datacenter,
    Deployment,
    FleetSettings,
    Tenant,
    Topology,
    parse_topology,
)

__all__ = [
    "FLEET",
    "BaseSelector",
    "DCSelector",
    "FleetMind",
    "PolicyContractError",
    "SkyLB",
    "candidates_for",
    "select_dc",
    "compliant",
    "data_region",
    "may_cross_region",
    "DCDecision",
    "DCView",
    "FleetCompletion",
    "FleetFirstToken",
    "FleetSnapshot",
    "PoolAccounting",
    "PoolCosts",
    "PoolView",
    "Datacenter",
    "Deployment",
    "FleetSettings",
    "Tenant",
    "Topology",
    "parse_topology",
    "DCStats",
    "Plan",
    "PlanAction",
    "Planner",
    "PlannerInput",
    "PoolStats",
    "RollbackEvent",
]
