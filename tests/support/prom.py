"""Reading an engine's Prometheus ``/metrics`` in tests."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics by name (labels dropped: one engine)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(requests.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            out[s.name] = s.value
    return out
