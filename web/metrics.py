"""Prometheus metrics of the API process, plus fleet state read from Redis.

Per-process series (requests, rejections, auth failures, TTFT) are plain
counters/histograms; fleet-wide state (tier shares, admission knobs, instance
health and age, queue depths, control-loop ticks) is read from Redis at scrape
time by a custom collector, so any API replica exposes the same picture.

Alerting labels: ``tenant`` and ``tier``. Tiers are a fixed set; tenants are
the bounded, admin-managed set of ``tokenfleet tenants`` (never a client-chosen
string: the label is the authenticated tenant id). As a guard against a fleet
with very many tenants, at most :data:`MAX_TENANT_LABELS` distinct tenants get
their own series per process; the rest share ``tenant="_other"``. Callers that
were never authenticated have no tenant: auth failures carry only a reason.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenfleet.live.procstat import stat_cpu_s

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
#: distinct tenant label values per process before new ones fold into "_other"
MAX_TENANT_LABELS = 500
#: the one Content-Type of /metrics: the text format generate_latest writes, charset once
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: label value when the tenant or tier is not known (refused before auth or validation)
UNKNOWN = "none"


class ApiMetrics:
    def __init__(self, gateway: Any, max_tenant_labels: int = MAX_TENANT_LABELS) -> None:
        self.registry = CollectorRegistry()
        self.max_tenant_labels = max_tenant_labels
        self._tenants: set[str] = set()
        self._tenants_lock = threading.Lock()
        self.requests = Counter(
            "tokenfleet_requests",
            "Requests finished, by tenant, tier and status (completed = met its SLO, "
            "slo_missed, rejected, failed, timeout, cancelled).",
            ["tenant", "tier", "status"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "tokenfleet_rejections",
            "Requests refused, by tenant, tier and reason (quota: the tenant's limits, "
            "capacity: admission at capacity, unavailable: no engine or store, "
            "forbidden: model or region not allowed).",
            ["tenant", "tier", "reason"],
            registry=self.registry,
        )
        self.auth_failures = Counter(
            "tokenfleet_auth_failures",
            "Requests refused with 401 (missing, malformed or unknown API key).",
            ["reason"],
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
            "Completion tokens relayed, by tenant and tier.",
            ["tenant", "tier"],
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
            "FleetMind datacenter choices of this API process, by DC and reason "
            "(home, spill, failover: home could not serve; best/nearest: no home DC).",
            ["dc", "reason"],
            registry=self.registry,
        )
        self.booking_rechecks = Counter(
            "tokenfleet_booking_rechecks",
            "Decisions made again because booking the dispatch showed another replica's "
            "(or a worker's) dispatch to that instance that this API's accounting copy "
            "lacked, by whether the request then went elsewhere (moved).",
            ["moved"],
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
        self.held_requests = Gauge(
            "tokenfleet_api_held_requests",
            "Requests the admission policy queued that this API process holds until it "
            "releases them, by tier.",
            ["tier"],
            registry=self.registry,
        )
        self.holds = Counter(
            "tokenfleet_api_holds",
            "Requests the admission policy queued and this API process held, by tier.",
            ["tier"],
            registry=self.registry,
        )
        self.registry.register(_LiveStateCollector(gateway))
        self.registry.register(ThreadCpuCollector())

    def tenant_label(self, tenant: str | None) -> str:
        """The tenant's label value, bounded (see the module docstring)."""
        if not tenant:
            return UNKNOWN
        if tenant in self._tenants:
            return tenant
        with self._tenants_lock:
            if len(self._tenants) >= self.max_tenant_labels:
                return "_other"
            self._tenants.add(tenant)
        return tenant

    def held(self, tier: str, delta: int) -> None:
        """``delta`` +1 when a request starts waiting, -1 when it stops."""
        self.held_requests.labels(tier).inc(delta)
        if delta > 0:
            self.holds.labels(tier).inc()

    def disconnect(self, how: str) -> None:
        self.disconnects.labels(how).inc()

    def booking_recheck(self, moved: bool) -> None:
        self.booking_rechecks.labels("true" if moved else "false").inc()

    def dc_decision(self, dc: str, reason: str) -> None:
        self.dc_decisions.labels(dc, reason.split(":")[0] or "none").inc()

    def finished(self, tier: str, status: str, tokens: int = 0, *, tenant: str = "") -> None:
        t = self.tenant_label(tenant)
        self.requests.labels(t, tier, status).inc()
        if tokens:
            self.output_tokens.labels(t, tier).inc(tokens)

    def first_token(self, tier: str, ttft_s: float) -> None:
        self.ttft.labels(tier).observe(ttft_s)

    def error(
        self,
        status: int,
        *,
        tenant: str | None = None,
        tier: str | None = None,
        reason: str | None = None,
    ) -> None:
        """An error response: counted by status, and as a rejection or an auth
        failure when it is one (``reason`` overrides the status's default)."""
        self.http_errors.labels(str(status)).inc()
        if status == 401:
            self.auth_failures.labels(reason or "invalid_api_key").inc()
            return
        why = reason or _REJECTION_REASONS.get(status)
        if why is not None:
            self.rejections.labels(self.tenant_label(tenant), tier or UNKNOWN, why).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


_NUMBERED = re.compile(r"[\s-]*(?:Thread-)?\d+$")
_UNNAMED = re.compile(r"^Thread-\d+ \((.+)\)$")


def thread_role(name: str) -> str:
    """A thread's name without its number: ``CP Server Thread-12`` -> ``CP Server``
    (the HTTP server's pool), ``Thread-3 (loop)`` -> ``loop``."""
    m = _UNNAMED.match(name)
    if m:
        return m.group(1)
    return _NUMBERED.sub("", name) or name


class ThreadCpuCollector:
    """``tokenfleet_api_thread_cpu_seconds_total{thread}``: this process's CPU by
    thread role (user + system, from ``/proc/self/task``; Linux only).

    Why: the API's CPU per request is spread over its threads (the HTTP
    server's pool, the stream pump, the ledger writer, the refresh and relay
    threads; docs/benchmarks.md, section 32), and an operator deciding what
    to scale or tune needs to see which. Threads of one role are summed; a
    thread that exited keeps what it had used at the last scrape, so the
    counter never goes down. A scrape reads one small file per thread:
    about 35 ms for 2,000 threads (a process holding 2,000 streams has as
    many server threads), measured with 2,000 idle threads on this
    project's 2-core machine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, tuple[str, float]] = {}  # native id -> (role, seconds)
        self._gone: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        if not os.path.isdir("/proc/self/task"):
            return
        now: dict[int, tuple[str, float]] = {}
        for t in threading.enumerate():
            tid = t.native_id
            used = None if tid is None else stat_cpu_s(f"/proc/self/task/{tid}/stat")
            if tid is not None and used is not None:
                now[tid] = (thread_role(t.name), used)
        fam = CounterMetricFamily(
            "tokenfleet_api_thread_cpu_seconds",
            "CPU (user + system) of this API process by thread role: 'CP Server' is the "
            "HTTP server's pool (the requests), 'stream-pump' carries streams past their "
            "first token, 'api-ledger' writes the ledger.",
            labels=["thread"],
        )
        with self._lock:
            for tid, (role, used) in self._last.items():
                seen = now.get(tid)
                # gone, or its id reused by a new thread (which starts from zero)
                if seen is None or seen[0] != role or seen[1] < used:
                    self._gone[role] = self._gone.get(role, 0.0) + used
            self._last = now
            totals = dict(self._gone)
        for role, used in now.values():
            totals[role] = totals.get(role, 0.0) + used
        for role, used in sorted(totals.items()):
            fam.add_metric([role], used)
        yield fam


#: statuses that are rejections (not client mistakes or server faults), by default reason
_REJECTION_REASONS = {403: "forbidden", 429: "capacity", 503: "unavailable"}


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
            targets = st.replica_targets()
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
        target = GaugeMetricFamily(
            "tokenfleet_replica_target",
            "FleetMind's planned replicas per datacenter, model and version (beat's "
            "long cycle); an autoscaler (HPA on an External metric, KEDA) can follow it.",
            labels=["dc", "model", "version"],
        )
        for (dc, model, version), n in sorted(targets.items()):
            target.add_metric([dc, model, version], n)
        yield target
        fam = CounterMetricFamily(
            "tokenfleet_fleet_events",
            "Fleet-wide counters kept in Redis (control ticks, fleet "
            "cycles, retries, duplicates, ...).",
            labels=["event"],
        )
        for name, v in sorted(counters.items()):
            fam.add_metric([name], v)
        yield fam
