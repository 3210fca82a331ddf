"""Benchmarks of the live path itself (``python benchmarks/live_overhead.py``).

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

Latency on a shared 2-core machine moves with whatever else runs on the
host; CPU time spent per request does much less. So the overhead run also
reports, per process of the stack, the CPU milliseconds (user + system,
from ``/proc``) it used per API request while the load ran. Compare code
changes by those when the latency figures are too noisy to.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, tests.support

from tests.support.stack import API_KEY, InstanceSpec, LiveStack
from tokenfleet.live.bench import hop_breakdown
from tokenfleet.live.httpclient import KeepAliveClient
from tokenfleet.live.procstat import stat_cpu_s


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


class _Caller(KeepAliveClient):
    def __init__(self, base_url: str, key: str | None) -> None:
        super().__init__(base_url, timeout_s=30)
        self.key = key

    def call(
        self, body: dict[str, Any], trace: dict[str, Any] | None = None
    ) -> tuple[float, float]:
        """(seconds to first content, seconds to end) of one streamed completion;
        ``trace`` gets the request id and wall-clock send/first-token times."""
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        wall0 = time.time()
        t0 = time.perf_counter()
        first = None
        try:
            resp = self.request(
                "POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers
            )
            if trace is not None:
                trace["rid"] = resp.getheader("X-Request-Id") or ""
            if resp.status != 200:
                resp.read()
                raise RuntimeError(f"HTTP {resp.status}")
            while True:
                data = resp.read1(65536)
                if not data:
                    break
                if (
                    first is None
                    and b'"content": "' in data
                    and b'"content": ""' not in data
                    or first is None
                    and data.count(b'"content"') > 1
                ):
                    first = time.perf_counter()
        except Exception:
            self.drop()
            raise
        end = time.perf_counter()
        if trace is not None:
            trace["sent"] = wall0
            trace["first"] = wall0 + ((first or end) - t0)
        return (first or end) - t0, end - t0


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux ``/proc``), or None."""
    return stat_cpu_s(f"/proc/{pid}/stat")


def stack_pids(stack: LiveStack) -> dict[str, int]:
    """The stack's processes by role (api, worker-*, engine-*, beat, redis), plus
    this benchmark process (``client``: both load generators)."""
    pids = {"client": os.getpid()}
    if stack.sup is not None:
        for name, child in stack.sup.children.items():
            if child.pid is not None:
                pids[name] = child.pid
    if stack.redis is not None and stack.redis.pid:
        pids["redis"] = stack.redis.pid
    return pids


_ECHO = (
    "import os\n"
    "while True:\n"
    "    b = os.read(0, 1)\n"
    "    if not b:\n"
    "        break\n"
    "    os.write(1, b)\n"
)


def wakeup_rtt_us(rounds: int = 2000) -> float:
    """Median round trip of one byte to another process and back (µs).

    Every hop of the live path wakes a process; on a virtual machine whose
    host is busy that wake-up, not our code, sets the pace. Printed next to
    the overhead so runs on a slow day can be told apart."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    assert child.stdin is not None and child.stdout is not None
    w, r = child.stdin.fileno(), child.stdout.fileno()
    rtts = []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            os.write(w, b"x")
            os.read(r, 1)
            rtts.append(time.perf_counter() - t0)
    finally:
        child.stdin.close()
        child.wait(timeout=5)
    return round(_pct(rtts, 50) * 1e6, 1)


class CpuMeter:
    """CPU seconds each process used between ``start()`` and ``stop()``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._t0: dict[str, float] = {}
        self.used_s: dict[str, float] = {}

    def start(self) -> None:
        self._t0 = {n: t for n, p in self.pids.items() if (t := _cpu_s(p)) is not None}

    def stop(self) -> None:
        for name, t0 in self._t0.items():
            t1 = _cpu_s(self.pids[name])
            if t1 is not None:
                self.used_s[name] = t1 - t0

    def per_request_ms(self, requests: int) -> dict[str, float]:
        out = {
            name: round(s * 1e3 / max(1, requests), 2) for name, s in sorted(self.used_s.items())
        }
        out["stack (all but client)"] = round(
            sum(s for n, s in self.used_s.items() if n != "client") * 1e3 / max(1, requests), 2
        )
        return out


def overhead(
    stack: LiveStack,
    rate_rps: float = 50.0,
    duration_s: float = 20.0,
    output_tokens: int = 8,
    traces: list[dict[str, Any]] | None = None,
    prompt_tokens: int = 0,
) -> dict[str, Any]:
    from benchmarks.cpu_per_request import make_prompt  # it imports this module

    api = _Caller(stack.url, API_KEY)
    direct = _Caller(next(iter(stack.engine_urls.values())), None)
    body = {
        "model": stack.model,
        "stream": True,
        "max_tokens": output_tokens,
        "vllm_xargs": {"output_tokens": output_tokens},
        "stream_options": {"include_usage": True},
    }
    res: dict[str, list[float]] = {
        "api_ttft": [],
        "api_e2e": [],
        "direct_ttft": [],
        "direct_e2e": [],
    }
    errors: dict[str, int] = {}
    lock = threading.Lock()

    def one(i: int, which: str) -> None:
        if prompt_tokens:  # a long prompt, 70 % of it shared by every request
            msgs = make_prompt(prompt_tokens, 0.7, i * 2 + (which == "api"))
        else:
            msgs = [{"role": "user", "content": f"overhead probe {i} {which}"}]
        trace: dict[str, Any] | None = {} if traces is not None and which == "api" else None
        try:
            ttft, e2e = (api if which == "api" else direct).call(dict(body, messages=msgs), trace)
        except Exception as exc:  # noqa: BLE001
            what = f"{which}: {exc.__class__.__name__}: {str(exc)[:80]}"
            with lock:
                errors[what] = errors.get(what, 0) + 1
            return
        with lock:
            res[f"{which}_ttft"].append(ttft)
            res[f"{which}_e2e"].append(e2e)
            if trace is not None and traces is not None and i >= 0:
                traces.append(trace)

    n = int(rate_rps * duration_s)
    # warm both paths
    for i in range(20):
        one(-i, "api")
        one(-i, "direct")
    for v in res.values():
        v.clear()
    wakeup_us = wakeup_rtt_us()
    meter = CpuMeter(stack_pids(stack))
    meter.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=64) as pool:
        for i in range(n):
            due = start + i / rate_rps
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, i, "api")
            pool.submit(one, i, "direct")
    meter.stop()
    out: dict[str, Any] = {
        "rate_rps": rate_rps,
        "requests": n,
        "errors": sum(errors.values()),
        "error_kinds": errors,
    }
    for q in (50, 90, 99):
        for metric in ("ttft", "e2e"):
            a, d = _pct(res[f"api_{metric}"], q), _pct(res[f"direct_{metric}"], q)
            out[f"api_{metric}_p{q}_ms"] = round(a * 1e3, 2)
            out[f"direct_{metric}_p{q}_ms"] = round(d * 1e3, 2)
            out[f"overhead_{metric}_p{q}_ms"] = round((a - d) * 1e3, 2)
    # the engine the direct requests go to also served them: its figure is
    # for two requests; "client" is both load generators
    out["cpu_ms_per_request"] = meter.per_request_ms(n)
    out["machine_wakeup_rtt_us"] = wakeup_us
    return out


def breakdown(
    stack: LiveStack, traces: list[dict[str, Any]], engine_log_dir: Path
) -> dict[str, Any]:
    """Median and p90 of each hop (ms): :func:`tokenfleet.live.bench.hop_breakdown`."""
    rows = stack.ledger_rows(timeout_s=3.0)
    return hop_breakdown(traces, rows, stack.gateway.state.request_state, engine_log_dir)


def throughput(stack: LiveStack, clients: int = 32, duration_s: float = 10.0) -> dict[str, Any]:
    api = _Caller(stack.url, API_KEY)
    body = {
        "model": stack.model,
        "stream": True,
        "max_tokens": 1,
        "vllm_xargs": {"output_tokens": 1},
    }
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
    return {
        "clients": clients,
        "completed": done[0],
        "req_per_s": round(done[0] / wall, 1),
        "e2e_p50_ms": round(_pct(lat, 50) * 1e3, 2),
        "e2e_p99_ms": round(_pct(lat, 99) * 1e3, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="engine instances (one worker each)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also report the median of each hop (ledger, Redis request "
        "state and engine request logs joined per request)",
    )
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="prompt length of the overhead run (byte-tokenizer tokens, 70%% shared); "
        "0: a few-token probe",
    )
    p.add_argument("--router", default="round_robin", help="the API's router")
    p.add_argument(
        "--admission",
        default="slomax",
        help="the API's admission policy (default slomax, as `tokenfleet api`; "
        "'none' admits everything)",
    )
    p.add_argument(
        "--broker-url",
        default=None,
        help="Celery broker (default: the embedded Redis), e.g. "
        "amqp://guest:guest@127.0.0.1:5672//",
    )
    p.add_argument(
        "--api-linger-s",
        type=float,
        default=None,
        help="the API server's linger on a keep-alive connection "
        "(LiveConfig.api_linger_s; 0 hands connections straight back)",
    )
    args = p.parse_args(argv)
    if args.json:  # before the run: a missing folder must not lose its results
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    from tests.support.stores import temp_data_dir

    report: dict[str, Any] = {}
    with temp_data_dir("tokenfleet-overhead-") as d:
        specs = [
            InstanceSpec("dc-a", f"a{i}", {"time_scale": 1e-4}, slots=64)
            for i in range(args.workers)
        ]
        log_dir = Path(d) / "engine-requests"
        log_dir.mkdir()
        stack = LiveStack(
            data_dir=d,
            instances=specs,
            with_postgres=True,
            time_scale=1e-4,
            router=args.router,
            engines_in_process=False,
            api_in_process=False,
            admission=args.admission,
            broker_url=args.broker_url,
            live_overrides={} if args.api_linger_s is None else {"api_linger_s": args.api_linger_s},
            engine_env={"TOKENFLEET_EMULATOR_REQUEST_LOG": str(log_dir / "{instance}.jsonl")}
            if args.breakdown
            else {},
        )
        stack.start()
        try:
            traces: list[dict[str, Any]] | None = [] if args.breakdown else None
            report["overhead"] = overhead(
                stack, args.rate, args.duration, traces=traces, prompt_tokens=args.prompt_tokens
            )
            if traces is not None:
                report["breakdown"] = breakdown(stack, traces, log_dir)
            if not args.no_throughput:
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
