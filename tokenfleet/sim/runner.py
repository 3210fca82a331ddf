"""Run one workload against several policies and collect comparable results."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.engine.profiles import EngineProfile
from tokenfleet.sim.cluster import PoolConfig, run_pool
from tokenfleet.sim.metrics import summarize
from tokenfleet.sim.records import RequestRecord
from tokenfleet.workloads.trace import TraceRequest

ProgressFactory = Callable[[str, int], Callable[[int, int], None]]


@dataclass
class SimSettings:
    profile: EngineProfile
    instances: int = 8
    scrape_interval_s: float = 0.1
    routers: int = 1
    seed: int = 0
    slo: SLOConfig = field(default_factory=SLOConfig)
    router_kwargs: dict[str, object] = field(default_factory=dict)


@dataclass
class PolicyRun:
    policy: str
    summary: dict[str, Any]
    records: list[RequestRecord]
    wall_s: float
    preemptions: int

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        out.update(self.summary)
        out["preemptions"] = self.preemptions
        out["wall_s"] = self.wall_s
        out["sim_requests_per_wall_s"] = (len(self.records) / self.wall_s
                                          if self.wall_s > 0 else None)
        return out


def run_policies(requests: Sequence[TraceRequest], policies: Sequence[str],
                 settings: SimSettings,
                 progress: ProgressFactory | None = None) -> list[PolicyRun]:
    for name in policies:
        ROUTERS.get(name)  # fail fast on a typo, before any work
    runs = []
    for name in policies:
        cfg = PoolConfig(profile=settings.profile, n_instances=settings.instances,
                         router=name, router_kwargs=dict(settings.router_kwargs),
                         n_routers=settings.routers,
                         scrape_interval_s=settings.scrape_interval_s, seed=settings.seed)
        cb = progress(name, len(requests)) if progress else None
        t0 = time.perf_counter()
        records, pool = run_pool(requests, cfg, settings.slo, progress=cb)
        wall = time.perf_counter() - t0
        summary = summarize(records, settings.slo, busy_s=pool.busy_s())
        runs.append(PolicyRun(name, summary, records, wall, pool.preemptions()))
    return runs
