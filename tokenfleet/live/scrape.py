"""Scrape a vLLM-compatible engine's ``/metrics`` into :class:`ScrapedMetrics`.

Metric names as vLLM V1 exports them (``vllm/v1/metrics/loggers.py``):
``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (older releases: ``vllm:gpu_cache_usage_perc``),
``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``
(tokens), and ``vllm:external_prefix_cache_hits_total`` (tokens a KV
connector such as the CPU offloading tier loaded). With several engines
behind one server (data parallel) gauges of counts and counters are summed
and KV usage is averaged. The text format is
parsed line by line: the scrape runs every few hundred milliseconds per
instance and needs nothing of the full exposition grammar.
"""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from tokenfleet.core.types import ScrapedMetrics

_SUMMED = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:prefix_cache_queries_total": "prefix_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_hits_total",
    "vllm:external_prefix_cache_hits_total": "external_hits_total",
}
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_metrics(text: str, now_s: float) -> ScrapedMetrics:
    """Parse Prometheus text exposition; unknown series are ignored."""
    sums: dict[str, float] = {}
    kv: dict[str, list[float]] = {name: [] for name in _KV}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name in _SUMMED:
            field = _SUMMED[name]
        elif name in kv:
            field = name
        else:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if field in kv:
            kv[field].append(value)
        else:
            sums[field] = sums.get(field, 0.0) + value
    usage = kv[_KV[0]] or kv[_KV[1]]
    return ScrapedMetrics(
        scraped_at_s=now_s,
        num_running=int(sums.get("num_running", 0)),
        num_waiting=int(sums.get("num_waiting", 0)),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        prefix_queries_total=int(sums.get("prefix_queries_total", 0)),
        prefix_hits_total=int(sums.get("prefix_hits_total", 0)),
        external_hits_total=int(sums.get("external_hits_total", 0)),
        healthy=True,
    )


def cache_config(text: str) -> dict[str, str]:
    """Labels of vLLM's ``vllm:cache_config_info`` gauge (``block_size``,
    ``prefix_caching_hash_algo``, ...); {} when the engine does not export it."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            body = line[line.find("{") + 1 : line.rfind("}")]
            out: dict[str, str] = {}
            for part in body.split('",'):
                key, _, value = part.partition("=")
                out[key.strip()] = value.strip().strip('"')
            return out
    return {}


@dataclass(slots=True)
class ScrapeResult:
    metrics: ScrapedMetrics
    error: str = ""


class Scraper:
    """Keeps one HTTP connection to the engine; ``scrape()`` never raises."""

    def __init__(self, base_url: str, timeout_s: float = 1.0) -> None:
        u = urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.https = u.scheme == "https"
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self.last = ScrapedMetrics()
        #: the previous scrape succeeded (then a timeout alone does not mark it unhealthy)
        self._ok_before = False

    def _get(self, path: str) -> tuple[int, bytes]:
        for attempt in range(2):
            if self._conn is None:
                cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
                self._conn = cls(self.host, self.port, timeout=self.timeout_s)
            try:
                self._conn.request("GET", path)
                resp = self._conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def scrape(self) -> ScrapeResult:
        """Health, then metrics. A non-200 answer or a failed connection marks it
        unhealthy, keeping the last good numbers (stale data beats no data for
        routing). A scrape that only timed out does so the second time in a row:
        one slow answer is as likely the scraping host's own CPU as the engine."""
        now = time.time()
        try:
            status, _ = self._get("/health")
            if status != 200:
                return self._unhealthy(now, f"/health answered {status}")
            status, body = self._get("/metrics")
            if status != 200:
                return self._unhealthy(now, f"/metrics answered {status}")
            self.last = parse_metrics(body.decode("utf-8", "replace"), now)
            self._ok_before = True
            return ScrapeResult(self.last)
        except TimeoutError as exc:
            if self._ok_before:
                self._ok_before = False
                # the last good numbers, with their own (older) scrape time
                return ScrapeResult(self.last, f"scrape timed out after a good one: {exc!r}")
            return self._unhealthy(now, f"scrape timed out again: {exc!r}")
        except (OSError, http.client.HTTPException) as exc:
            return self._unhealthy(now, f"scrape failed: {exc!r}")

    def _unhealthy(self, now: float, why: str) -> ScrapeResult:
        self._ok_before = False
        return ScrapeResult(replace(self.last, scraped_at_s=now, healthy=False), why)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
