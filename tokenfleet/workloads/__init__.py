"""Workloads: trace loaders, synthetic generators and load scaling.

Formats, the ``max_tokens`` rule and the capacity estimate are documented in
docs/workloads.md.
"""

from __future__ import annotations

from tokenfleet.workloads.common import DEFAULT_MAX_TOKENS
from tokenfleet.workloads.loader import FORMATS, clear_cache, detect_format, load_workload
from tokenfleet.workloads.scaling import (
    capacity_rps,
    limit,
    offered_rps,
    rate_scale,
    scale_to_load,
)
from tokenfleet.workloads.synthetic import SYNTHETIC, generate
from tokenfleet.workloads.trace import TraceRequest

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "FORMATS",
    "SYNTHETIC",
    "TraceRequest",
    "capacity_rps",
    "clear_cache",
    "detect_format",
    "generate",
    "limit",
    "load_workload",
    "offered_rps",
    "rate_scale",
    "scale_to_load",
]
