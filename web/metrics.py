"""Prometheus metrics of the API process, plus fleet state read from Redis.

Per-process series (requests, TTFT) are plain counters/histograms; fleet-wide
state (tier shares, admission knobs, instance health and age, queue depths,
control-loop ticks) is read from Redis at scrape time by a custom collector,
so any API replica exposes the same picture.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ApiMetrics:
    def __init__(self, gateway: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenfleet_requests",
            "Requests finished, by tier and status.",
            ["tier", "status"],
            registry=self.registry,
        )
        self.http_errors = Counter(
            "tokenfleet_http_errors",
            "Error responses by status.",
            ["status"],
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "tokenfleet_output_tokens",
            "Completion tokens relayed.",
            ["tier"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tokenfleet_ttft_seconds",
            "Time to first token seen by the API.",
            ["tier"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.dc_decisions = Counter(
            "tokenfleet_dc_decisions",
            "FleetMind datacenter choices of this API process, "
            "by DC and reason (home, spill, failover, ...).",
            ["dc", "reason"],
            registry=self.registry,
        )
        self.disconnects = Counter(
            "tokenfleet_client_disconnects",
            "Requests whose client left before the end, by how the API noticed: "
            "socket_eof (the socket said so while waiting) or write_failed (the "
            "server stopped the stream, e.g. a failed write).",
            ["how"],
            registry=self.registry,
        )
        self.registry.register(_LiveStateCollector(gateway))

    def disconnect(self, how: str) -> None:
        self.disconnects.labels(how).inc()

    def dc_decision(self, dc: str, reason: str) -> None:
        self.dc_decisions.labels(dc, reason.split(":")[0] or "none").inc()

    def finished(self, tier: str, status: str, tokens: int = 0) -> None:
        self.requests.labels(tier, status).inc()
        if tokens:
            self.output_tokens.labels(tier).inc(tokens)

    def first_token(self, tier: str, ttft_s: float) -> None:
        self.ttft.labels(tier).observe(ttft_s)

    def error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveStateCollector:
    def __init__(self, gateway: Any) -> None:
        self.gw = gateway

    def collect(self) -> Iterator[Metric]:
        st = self.gw.state
        try:
            infos = st.instances()
            shares = st.shares()
            thresholds = st.thresholds()
            counters = st.counters()
            queued = st.queued()
        except Exception:  # noqa: BLE001 - Redis down: say so, keep the rest
            up = GaugeMetricFamily("tokenfleet_redis_up", "1 if Redis answered this scrape.")
            up.add_metric([], 0)
            yield up
            return
        up = GaugeMetricFamily("tokenfleet_redis_up", "1 if Redis answered this scrape.")
        up.add_metric([], 1)
        yield up
        now = time.time()
        stale = self.gw.live.stale_after_s
        healthy = GaugeMetricFamily(
            "tokenfleet_instance_healthy",
            "1 if the instance is live and healthy.",
            labels=["dc", "instance"],
        )
        age = GaugeMetricFamily(
            "tokenfleet_instance_snapshot_age_seconds",
            "Seconds since the instance's worker last wrote its snapshot.",
            labels=["dc", "instance"],
        )
        running = GaugeMetricFamily(
            "tokenfleet_instance_running",
            "Requests running on the engine (last scrape).",
            labels=["dc", "instance"],
        )
        waiting = GaugeMetricFamily(
            "tokenfleet_instance_waiting",
            "Requests waiting in the engine (last scrape).",
            labels=["dc", "instance"],
        )
        for i in infos:
            lv = [i.dc, i.instance_id]
            healthy.add_metric(lv, 1 if i.is_healthy(now, stale) else 0)
            age.add_metric(lv, max(0.0, i.age_s(now)))
            running.add_metric(lv, i.metrics.num_running)
            waiting.add_metric(lv, i.metrics.num_waiting)
        yield from (healthy, age, running, waiting)
        share = GaugeMetricFamily(
            "tokenfleet_tier_share",
            "Share of each engine's slots a tier may use (SLOMax).",
            labels=["tier"],
        )
        for tier, v in shares.items():
            share.add_metric([tier], v)
        yield share
        knobs = GaugeMetricFamily(
            "tokenfleet_admission_knob",
            "Admission knobs written by the control loop.",
            labels=["knob"],
        )
        for k, v in thresholds.items():
            if v is not None:
                knobs.add_metric([k], v)
        yield knobs
        depth = GaugeMetricFamily(
            "tokenfleet_queue_depth", "Requests waiting per queue.", labels=["queue"]
        )
        for q, n in queued.items():
            depth.add_metric([q], n)
        yield depth
        fam = CounterMetricFamily(
            "tokenfleet_fleet_events",
            "Fleet-wide counters kept in Redis (control ticks, fleet "
            "cycles, retries, duplicates, ...).",
            labels=["event"],
        )
        for name, v in sorted(counters.items()):
            fam.add_metric([name], v)
        yield fam
