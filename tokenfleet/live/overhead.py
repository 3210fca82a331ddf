"""Benchmarks of the live path itself (``python -m tokenfleet.live.overhead``).

1. **Overhead** of API + Celery + worker + Redis Stream over calling the
   emulator directly, at a fixed open-loop rate (default 50 req/s): every
   request is sent twice at the same moment's load, once through the API and
   once straight to the engine, both streamed, and we compare time to first
   token and to the end. Overhead pXX = pXX(via API) - pXX(direct).
2. **Throughput**: closed-loop clients against the API with a near
   zero-latency engine (``time_scale`` 1e-4), completed requests per second.

Everything runs on this machine (embedded Redis, real worker processes), so
the numbers include the emulator's own CPU time; on a loaded 2-core box they
are pessimistic.
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tokenfleet.live.testing import API_KEY, InstanceSpec, LiveStack


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


class _Caller:
    def __init__(self, base_url: str, key: str | None) -> None:
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.key = key
        self._local = threading.local()

    def call(self, body: dict[str, Any]) -> tuple[float, float]:
        """(seconds to first content, seconds to end) of one streamed completion."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port,
                                                                 timeout=30)
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        t0 = time.perf_counter()
        first = None
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                raise RuntimeError(f"HTTP {resp.status}")
            while True:
                data = resp.read1(65536)
                if not data:
                    break
                if first is None and b'"content": "' in data and b'"content": ""' not in data:
                    first = time.perf_counter()
                elif first is None and data.count(b'"content"') > 1:
                    first = time.perf_counter()
        except Exception:
            conn.close()
            self._local.conn = None
            raise
        end = time.perf_counter()
        return (first or end) - t0, end - t0


def overhead(stack: LiveStack, rate_rps: float = 50.0, duration_s: float = 20.0,
             output_tokens: int = 8) -> dict[str, Any]:
    api = _Caller(stack.url, API_KEY)
    direct = _Caller(next(iter(stack.engine_urls.values())), None)
    body = {"model": stack.model, "stream": True, "max_tokens": output_tokens,
            "vllm_xargs": {"output_tokens": output_tokens},
            "stream_options": {"include_usage": True}}
    res: dict[str, list[float]] = {"api_ttft": [], "api_e2e": [], "direct_ttft": [],
                                   "direct_e2e": []}
    errors = [0]
    lock = threading.Lock()

    def one(i: int, which: str) -> None:
        msg = {"role": "user", "content": f"overhead probe {i} {which}"}
        try:
            ttft, e2e = (api if which == "api" else direct).call(dict(body, messages=[msg]))
        except Exception:  # noqa: BLE001
            with lock:
                errors[0] += 1
            return
        with lock:
            res[f"{which}_ttft"].append(ttft)
            res[f"{which}_e2e"].append(e2e)

    n = int(rate_rps * duration_s)
    # warm both paths
    for i in range(20):
        one(-i, "api")
        one(-i, "direct")
    for v in res.values():
        v.clear()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=64) as pool:
        for i in range(n):
            due = start + i / rate_rps
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i, "api")
            pool.submit(one, i, "direct")
    out: dict[str, Any] = {"rate_rps": rate_rps, "requests": n, "errors": errors[0]}
    for q in (50, 90, 99):
        for metric in ("ttft", "e2e"):
            a, d = _pct(res[f"api_{metric}"], q), _pct(res[f"direct_{metric}"], q)
            out[f"api_{metric}_p{q}_ms"] = round(a * 1e3, 2)
            out[f"direct_{metric}_p{q}_ms"] = round(d * 1e3, 2)
            out[f"overhead_{metric}_p{q}_ms"] = round((a - d) * 1e3, 2)
    return out


def throughput(stack: LiveStack, clients: int = 32, duration_s: float = 10.0) -> dict[str, Any]:
    api = _Caller(stack.url, API_KEY)
    body = {"model": stack.model, "stream": True, "max_tokens": 1,
            "vllm_xargs": {"output_tokens": 1}}
    stop = time.perf_counter() + duration_s
    done = [0]
    lat: list[float] = []
    lock = threading.Lock()

    def loop(k: int) -> None:
        i = 0
        while time.perf_counter() < stop:
            try:
                _, e2e = api.call(dict(body, messages=[{"role": "user", "content": f"t{k}-{i}"}]))
            except Exception:  # noqa: BLE001
                continue
            i += 1
            with lock:
                done[0] += 1
                lat.append(e2e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "completed": done[0], "req_per_s": round(done[0] / wall, 1),
            "e2e_p50_ms": round(_pct(lat, 50) * 1e3, 2),
            "e2e_p99_ms": round(_pct(lat, 99) * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="engine instances (one worker each)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from tokenfleet.service.testing import temp_data_dir

    report: dict[str, Any] = {}
    with temp_data_dir("tokenfleet-overhead-") as d:
        specs = [InstanceSpec("dc-a", f"a{i}", {"time_scale": 1e-4}, slots=64)
                 for i in range(args.workers)]
        stack = LiveStack(data_dir=d, instances=specs, with_postgres=True, time_scale=1e-4,
                          router="round_robin", app_config={"CHAT_QUOTAS": False},
                          engines_in_process=False, api_in_process=False,
                          admission="none")
        stack.start()
        try:
            report["overhead"] = overhead(stack, args.rate, args.duration)
            report["throughput"] = throughput(stack, args.clients)
        finally:
            stack.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


