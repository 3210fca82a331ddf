"""Run one workload against several policies and collect comparable results."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.engine.profiles import EngineProfile
from tokenfleet.sim.cluster import PathLatency, PoolConfig, PoolSim, run_pool
from tokenfleet.sim.metrics import summarize
from tokenfleet.sim.records import RequestRecord
from tokenfleet.workloads.trace import TraceRequest

ProgressFactory = Callable[[str, int], Callable[[int, int], None]]


def engines_publish_kv_events(router: str) -> bool:
    """Whether ``router``'s shipped deployment has its engines publish KV
    events (a router class says so with ``engines_publish_kv_events = True``;
    Dynamo's vLLM workers do by default, see docs/tokenpilot.md)."""
    return bool(getattr(ROUTERS.get(router), "engines_publish_kv_events", False))


@dataclass
class SimSettings:
    profile: EngineProfile
    instances: int = 8
    scrape_interval_s: float = 0.1
    routers: int = 1
    seed: int = 0
    slo: SLOConfig = field(default_factory=SLOConfig)
    router_kwargs: dict[str, object] = field(default_factory=dict)
    admission_kwargs: dict[str, dict[str, object]] = field(default_factory=dict)  # per policy
    control_period_s: float = 5.0
    #: engines publish KV events (BlockStored/BlockRemoved) to the routers:
    #: True / False for every run; None (default) each router's shipped
    #: deployment (:func:`engines_publish_kv_events`)
    kv_events: bool | None = None
    #: latency of the live request path (zero: the idealised path)
    path_latency: PathLatency = field(default_factory=PathLatency)
    #: router replicas share dispatch accounting this late (None: independent)
    shared_state_s: float | None = None
    #: with shared state: re-decide when the booking shows an unseen dispatch
    booking_check: bool = True
    #: extra keyword arguments for disaggregating (P/D) routers only
    pd_router_kwargs: dict[str, object] = field(default_factory=dict)

    def kv_events_for(self, router: str) -> bool:
        if self.kv_events is None:
            return engines_publish_kv_events(router)
        return self.kv_events

    def pool_config(self, router: str) -> PoolConfig:
        kwargs = dict(self.router_kwargs)
        if getattr(ROUTERS.get(router), "disaggregating", False):
            kwargs.update(self.pd_router_kwargs)
        return PoolConfig(
            profile=self.profile,
            n_instances=self.instances,
            router=router,
            router_kwargs=kwargs,
            n_routers=self.routers,
            scrape_interval_s=self.scrape_interval_s,
            seed=self.seed,
            kv_events=self.kv_events_for(router),
            path_latency=self.path_latency,
            shared_state_s=self.shared_state_s,
            booking_check=self.booking_check,
        )


@dataclass
class PolicyRun:
    policy: str
    summary: dict[str, Any]
    records: list[RequestRecord]
    wall_s: float
    preemptions: int
    admission: str | None = None  # None: no admission layer (routers only)
    admission_report: dict[str, Any] | None = None
    kv_events: bool = False  # the engines published KV events to the router

    @property
    def label(self) -> str:
        return self.policy if self.admission is None else f"{self.policy}+{self.admission}"

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        if self.admission is not None:
            out["admission"] = self.admission
            out["label"] = self.label
        out.update(self.summary)
        if self.admission_report is not None:
            out["admission_report"] = self.admission_report
        out["kv_events"] = self.kv_events
        out["preemptions"] = self.preemptions
        out["wall_s"] = self.wall_s
        out["sim_requests_per_wall_s"] = (
            len(self.records) / self.wall_s if self.wall_s > 0 else None
        )
        return out


def run_policies(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    settings: SimSettings,
    progress: ProgressFactory | None = None,
    admissions: Sequence[str] = (),
) -> list[PolicyRun]:
    """Every router in ``policies``; with ``admissions``, every (router,
    admission) pair, the admission layer sitting in front of the router."""
    for name in policies:
        ROUTERS.get(name)  # fail fast on a typo, before any work
    if admissions:
        return _run_with_admission(requests, policies, admissions, settings, progress)
    runs = []
    for name in policies:
        cfg = settings.pool_config(name)
        cb = progress(name, len(requests)) if progress else None
        t0 = time.perf_counter()
        records, pool = run_pool(requests, cfg, settings.slo, progress=cb)
        wall = time.perf_counter() - t0
        summary = _summary(records, settings, pool)
        runs.append(
            PolicyRun(name, summary, records, wall, pool.preemptions(), kv_events=cfg.kv_events)
        )
    return runs


def _summary(records: list[RequestRecord], settings: SimSettings, pool: PoolSim) -> dict[str, Any]:
    out = summarize(records, settings.slo, busy_s=pool.busy_s())
    if settings.shared_state_s is not None and settings.routers > 1:
        # decisions made again because the booking showed another replica's dispatch
        out["booking_rechecks"] = pool.booking_rechecks
    return out


def _run_with_admission(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    admissions: Sequence[str],
    settings: SimSettings,
    progress: ProgressFactory | None,
) -> list[PolicyRun]:
    from tokenfleet.core.admission import ADMISSION
    from tokenfleet.sim.admission import admission_report, run_pool_with_admission

    for adm in admissions:
        ADMISSION.get(adm)  # fail fast on a typo
    runs = []
    for name in policies:
        for adm in admissions:
            cfg = settings.pool_config(name)
            label = f"{name}+{adm}"
            cb = progress(label, len(requests)) if progress else None
            t0 = time.perf_counter()
            records, pool, driver = run_pool_with_admission(
                requests,
                cfg,
                settings.slo,
                adm,
                admission_kwargs=dict(settings.admission_kwargs.get(adm, {})),
                control_period_s=settings.control_period_s,
                progress=cb,
            )
            wall = time.perf_counter() - t0
            summary = _summary(records, settings, pool)
            report = admission_report(records, driver, settings.slo)
            runs.append(
                PolicyRun(
                    name,
                    summary,
                    records,
                    wall,
                    pool.preemptions(),
                    admission=adm,
                    admission_report=report,
                    kv_events=cfg.kv_events,
                )
            )
    return runs
