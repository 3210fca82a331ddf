"""Prometheus metrics with vLLM's names, labels and buckets.

Names follow ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``): every
series carries ``model_name`` (the first served model name) and ``engine``
("0"). Counters are declared without ``_total``; the exposition adds it, as
in vLLM. Gauges and counters that mirror engine state are read from the
engine at scrape time (a custom collector), so they are exact; latency
histograms are observed by the step loop, in wall-clock seconds, i.e. what a
client sees (model seconds times ``time_scale``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LABELS = ["model_name", "engine"]

# Buckets as in vLLM's PrometheusStatLogger.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
TPOT_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
E2E_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class EngineState:
    running: int
    waiting: int
    kv_usage: float
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_gpu_blocks: int
    block_size: int
    # the host tier (vLLM's KV connector counters; all 0 when it is off)
    external_queries_tokens: int = 0
    external_hits_tokens: int = 0
    num_cpu_blocks: int = 0
    cpu_blocks_used: int = 0
    # P/D disaggregation (NixlConnector-style transfers; 0 when unused)
    kv_transfer_in_tokens: int = 0
    kv_transfer_in_s: float = 0.0
    kv_transfer_out_tokens: int = 0
    kv_held_blocks: int = 0


class EmulatorMetrics:
    """One registry per emulator, so several can run in one process."""

    def __init__(self, model_name: str, engine_index: str = "0") -> None:
        self.model_name = model_name
        self.engine_index = engine_index
        self.registry = CollectorRegistry()
        lv = (model_name, engine_index)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*lv)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            LABELS,
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        ).labels(*lv)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            LABELS,
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        ).labels(*lv)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(*lv)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            LABELS + ["finished_reason"],
            registry=self.registry,
        )
        self.success = {r: success.labels(model_name, engine_index, r) for r in FINISH_REASONS}
        self._state: Callable[[], EngineState] | None = None
        self.registry.register(_StateCollector(self))

    def attach(self, state: Callable[[], EngineState]) -> None:
        self._state = state

    def state(self) -> EngineState | None:
        return self._state() if self._state is not None else None

    # -- observations (called by the step loop) ---------------------------------
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, tokens: int = 1) -> None:
        # Several tokens in one step (not the case in this engine) share the gap.
        per = seconds / tokens
        for _ in range(tokens):
            self.tpot.observe(per)
            self.itl.observe(per)

    def request_finished(self, reason: str, arrival_s: float, now_s: float) -> None:
        self.success[reason].inc()
        self.e2e.observe(now_s - arrival_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Engine gauges and counters read at scrape time."""

    def __init__(self, metrics: EmulatorMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        s = self._m.state()
        if s is None:
            return
        lv = [self._m.model_name, self._m.engine_index]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, value)
            return c

        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", s.running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage
        )
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            s.kv_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queries_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hits_tokens,
        )
        if s.num_cpu_blocks or s.external_queries_tokens:
            # vLLM counts what KV connectors (the OffloadingConnector, a P/D
            # transfer) are asked for and serve: tokens past the local (GPU) hit
            yield counter(
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache "
                "sharing, in terms of number of queried tokens.",
                s.external_queries_tokens,
            )
            yield counter(
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache "
                "sharing, in terms of number of cached tokens.",
                s.external_hits_tokens,
            )
        if s.num_cpu_blocks:
            # not a vLLM series: the host tier's occupancy, for dashboards and tests
            yield gauge(
                "tokenfleet:kv_offload_cpu_usage_perc",
                "Host-memory KV tier usage (OffloadingConnector). 1 means 100 percent usage.",
                s.cpu_blocks_used / s.num_cpu_blocks,
            )
        if s.kv_transfer_in_tokens or s.kv_transfer_out_tokens or s.kv_held_blocks:
            # not vLLM series (its NIXL stats differ by version): what P/D moved
            yield counter(
                "tokenfleet:kv_transfer_received_tokens",
                "Prompt tokens whose KV this (decode) instance received from a prefill instance.",
                s.kv_transfer_in_tokens,
            )
            yield counter(
                "tokenfleet:kv_transfer_received_seconds",
                "Model seconds the received KV transfers took.",
                s.kv_transfer_in_s,
            )
            yield counter(
                "tokenfleet:kv_transfer_sent_tokens",
                "Prompt tokens whose KV a decode instance read from this (prefill) instance.",
                s.kv_transfer_out_tokens,
            )
            yield gauge(
                "tokenfleet:kv_transfer_held_blocks",
                "KV blocks this prefill instance holds until a decode instance reads them.",
                s.kv_held_blocks,
            )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "engine"],
        )
        info.add_metric([str(s.block_size), str(s.num_gpu_blocks), self._m.engine_index], 1)
        yield info
