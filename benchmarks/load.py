"""Overload benchmark of one API process: many streams, sustained short chats.

Reproduces the figures of the outside attack on a running ``tokenfleet up``
(issue #16) and prints them as JSON:

* ``streams``: N concurrent streamed chats (opened over ``--ramp-s``) against
  a slow emulated engine: time to first byte (p50/p90/p99/max), how many got
  tokens to ``[DONE]``, were refused (429/503, with their Retry-After), hit
  the client timeout or failed otherwise; ``/health`` probed every 0.5 s all
  along (max latency, failures).
* ``rates``: open-loop short non-streamed chats at each of ``--rates`` req/s
  for ``--duration-s``, client timeout ``--client-timeout-s``: ok, client
  timeouts, refusals, other errors, ``/health`` max latency; then the
  ledger's status counts for the requests of that phase.
* ``abandon``: non-streamed requests whose client closes the connection
  after a second: the ledger should say ``cancelled``.
* the API process's RSS after each phase.

It starts ``tokenfleet up`` from ``--src`` (default: this checkout), so the
same client measures another tree, e.g. the code before a change::

    git worktree add /tmp/tf-before ef7d4d7
    python benchmarks/load.py --src /tmp/tf-before
    python benchmarks/load.py

The client is a minimal asyncio HTTP/1.1 client (one connection per request,
``Connection: close``) so that thousands of concurrent requests cost this
process little; the machine is shared with the stack under test, so the
numbers move with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "tf-load-bench"


@dataclass
class Result:
    status: int = 0  # HTTP status; 0 = no response
    ttfb_s: float | None = None
    total_s: float = 0.0
    outcome: str = ""  # ok | refused | timeout | error
    retry_after: str = ""
    sent_at: float = 0.0


class Open:
    """How many streams are open and past their first byte now, and the peak."""

    now = 0
    peak = 0

    @classmethod
    def add(cls, n: int) -> None:
        cls.now += n
        cls.peak = max(cls.peak, cls.now)


@dataclass
class Probes:
    latencies_s: list[float] = field(default_factory=list)
    failures: int = 0
    #: (seconds since the phase began, latency) of each probe over 100 ms
    slow: list[tuple[float, float]] = field(default_factory=list)
    #: (seconds since the phase began, how late) of each wake-up of the prober's
    #: bare stall thread at least HOST_STALL_S late: the host ran no thread of
    #: a process that did nothing else
    host_stalls: list[tuple[float, float]] = field(default_factory=list)


#: the prober's stall thread sleeps this long at a time
HOST_TICK_S = 0.01
#: a wake-up this late (seconds) is a host stall
HOST_STALL_S = 0.05


def during_host_stall(at_s: float, took_s: float, stalls: list[tuple[float, float]]) -> bool:
    """A probe sent at ``at_s`` that took ``took_s`` overlapped a host stall: a
    stall ending at ``t`` after ``late`` seconds covered ``[t - late, t]``."""
    return any(t - late < at_s + took_s and t > at_s for t, late in stalls)


async def http_request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes | None,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    close_after_s: float | None = None,
) -> Result:
    """One request on a fresh connection; reads to EOF (``Connection: close``)."""
    res = Result(sent_at=time.monotonic())
    t0 = res.sent_at
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
            for k, v in (headers or {}).items():
                head.append(f"{k}: {v}")
            if body is not None:
                head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
            await writer.drain()
            if close_after_s is not None:
                await asyncio.sleep(close_after_s)
                res.outcome = "abandoned"
                return res
            first = await reader.read(65536)
            res.ttfb_s = time.monotonic() - t0
            if not first:
                res.outcome = "error"
                return res
            status_line = first.split(b"\r\n", 1)[0].split()
            res.status = int(status_line[1]) if len(status_line) > 1 else 0
            data = bytearray(first)
            streaming = res.status == 200 and b"text/event-stream" in first
            if streaming:
                Open.add(1)
            try:
                while chunk := await reader.read(65536):
                    data += chunk
            finally:
                if streaming:
                    Open.add(-1)
            for line in bytes(data).split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
                if line.lower().startswith(b"retry-after:"):
                    res.retry_after = line.split(b":", 1)[1].strip().decode()
            if res.status == 200:
                is_stream = b"text/event-stream" in data[:2048]
                res.outcome = "ok" if (not is_stream or b"[DONE]" in data) else "error"
            elif res.status in (429, 503):
                res.outcome = "refused"
            else:
                res.outcome = "error"
    except TimeoutError:
        res.outcome = "timeout"
    except OSError:
        res.outcome = "error"
    finally:
        res.total_s = time.monotonic() - t0
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    return res


def chat_body(model: str, tokens: int, stream: bool) -> bytes:
    """``tokens`` > 0: exactly that many output tokens; 0: no ``max_tokens``, the
    emulator draws the length (lognormal, median 128 tokens), as a plain chat."""
    body: dict[str, Any] = {
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell me a short story about a fleet."}],
    }
    if tokens > 0:
        body["max_tokens"] = tokens
        body["vllm_xargs"] = {"output_tokens": tokens}
    return json.dumps(body).encode()


def _probe_main(host: str, port: int, conn: Connection) -> None:
    """``/health`` every 0.5 s with a blocking socket, in its own process: the
    asyncio client carrying thousands of streams would otherwise add its own
    loop's delay to each probe. A second thread of this process does nothing
    but wake every 10 ms: when it wakes late, the machine ran none of this
    process's threads, and a slow probe then is the host's as much as the API's."""
    lat: list[float] = []
    slow: list[tuple[float, float]] = []
    stalls: list[tuple[float, float]] = []
    failures = 0
    began = time.monotonic()
    done = threading.Event()

    def watch_host() -> None:
        while True:
            t0 = time.monotonic()
            if done.wait(HOST_TICK_S):
                return
            now = time.monotonic()
            late = now - t0 - HOST_TICK_S
            if late >= HOST_STALL_S:
                stalls.append((round(now - began, 3), round(late, 3)))

    watcher = threading.Thread(target=watch_host, daemon=True)
    watcher.start()
    while not conn.poll(0.5):
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=30.0) as s:
                head = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close"
                s.sendall(head.encode() + b"\r\n\r\n")
                first = s.recv(4096)
                dt = time.monotonic() - t0
                parts = first.split(b"\r\n", 1)[0].split()
                status = int(parts[1]) if len(parts) > 1 else 0
                while s.recv(65536):
                    pass
            if status in (200, 503):
                lat.append(dt)
                if dt > 0.1:
                    slow.append((round(t0 - began, 3), round(dt, 3)))
            else:
                failures += 1
        except OSError:
            failures += 1
    done.set()
    watcher.join(1.0)
    conn.send((lat, failures, slow, stalls))


class HealthProber:
    """The ``/health`` prober's process, started and stopped around a phase."""

    def __init__(self, host: str, port: int) -> None:
        self._conn, child = multiprocessing.Pipe()
        self._proc = multiprocessing.Process(target=_probe_main, args=(host, port, child))
        self._proc.start()

    def stop(self) -> Probes:
        self._conn.send(None)
        lat, failures, slow, stalls = self._conn.recv()
        self._proc.join(10)
        return Probes(lat, failures, slow, stalls)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


def summarize(results: list[Result], probes: Probes) -> dict[str, Any]:
    by: dict[str, int] = {}
    for r in results:
        by[r.outcome] = by.get(r.outcome, 0) + 1
    ttfb = [r.ttfb_s for r in results if r.ttfb_s is not None and r.outcome == "ok"]
    refused_ttfb = [r.ttfb_s for r in results if r.ttfb_s is not None and r.outcome == "refused"]
    retry = sorted({r.retry_after for r in results if r.outcome == "refused"})
    host_slow = [
        (at, dt) for at, dt in probes.slow if during_host_stall(at, dt, probes.host_stalls)
    ]
    outside = [dt for at, dt in probes.slow if (at, dt) not in host_slow]
    fast = [x for x in probes.latencies_s if x <= 0.1]
    fast_max = round(max(fast), 3) if fast else None
    return {
        "requests": len(results),
        "outcomes": by,
        "ok_ttfb_s": {q: pct(ttfb, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        | {"max": round(max(ttfb), 3) if ttfb else None},
        "refused_ttfb_max_s": round(max(refused_ttfb), 3) if refused_ttfb else None,
        "retry_after_values": retry[:10],
        "health": {
            "probes": len(probes.latencies_s) + probes.failures,
            "failures": probes.failures,
            "max_s": round(max(probes.latencies_s), 3) if probes.latencies_s else None,
            "p50_s": pct(probes.latencies_s, 0.5),
            "p99_s": pct(probes.latencies_s, 0.99),
            "over_100ms": sum(1 for x in probes.latencies_s if x > 0.1),
            "over_100ms_at_s": [round(at, 1) for at, _ in probes.slow[:40]],
            # the slow probes during which a bare process on the machine was not run
            # either, and the slowest probe of the others (None: all were)
            "over_100ms_during_host_stall": len(host_slow),
            "max_s_outside_host_stalls": max(outside) if outside else fast_max,
            "host_stalls": len(probes.host_stalls),
            "host_stall_max_s": max((late for _, late in probes.host_stalls), default=0.0),
        },
    }


async def run_streams(
    host: str, port: int, model: str, n: int, ramp_s: float, tokens: int, timeout_s: float
) -> dict[str, Any]:
    prober = HealthProber(host, port)
    body = chat_body(model, tokens, True)
    hdr = {"Authorization": f"Bearer {API_KEY}"}
    tasks = []
    t0 = time.monotonic()
    for i in range(n):
        at = t0 + ramp_s * i / max(1, n)
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        tasks.append(
            asyncio.create_task(
                http_request(host, port, "POST", "/v1/chat/completions", body, timeout_s, hdr)
            )
        )
    results = await asyncio.gather(*tasks)
    probes = prober.stop()
    out = summarize(list(results), probes)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["peak_open_streams"] = Open.peak
    return out


async def run_rate(
    host: str,
    port: int,
    model: str,
    rate: float,
    duration_s: float,
    timeout_s: float,
    tokens: int,
) -> dict[str, Any]:
    prober = HealthProber(host, port)
    body = chat_body(model, tokens, False)
    hdr = {"Authorization": f"Bearer {API_KEY}"}
    n = int(rate * duration_s)
    tasks = []
    t0 = time.monotonic()
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        tasks.append(
            asyncio.create_task(
                http_request(host, port, "POST", "/v1/chat/completions", body, timeout_s, hdr)
            )
        )
    results = await asyncio.gather(*tasks)
    probes = prober.stop()
    return summarize(list(results), probes)


async def run_abandon(host: str, port: int, model: str, n: int) -> None:
    body = chat_body(model, 2000, False)
    hdr = {"Authorization": f"Bearer {API_KEY}"}
    await asyncio.gather(
        *(
            http_request(
                host, port, "POST", "/v1/chat/completions", body, 30.0, hdr, close_after_s=1.0
            )
            for _ in range(n)
        )
    )


# -- the stack under test ------------------------------------------------------------------
def api_pid(port: int) -> int | None:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"api" in argv and b"--port" in argv and str(port).encode() in argv:
            return int(d.name)
    return None


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def threads_of(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


_TICK = os.sysconf("SC_CLK_TCK")


def _label(argv: list[str]) -> str:
    """A short name for one process of the stack (what ``up`` started)."""
    joined = " ".join(argv)
    for word, name in (
        ("engine-sim", "engines"),
        (" worker ", "workers"),
        (" beat", "beat"),
        (" api", "api"),
        ("redis", "redis"),
        ("postgres", "postgres"),
    ):
        if word in f" {joined} ":
            return name
    return "other"


def _stack(root_pid: int) -> dict[int, list[str]]:
    """``/proc/PID/stat`` fields (after the command name) of ``root_pid`` and
    every process below it."""
    parent: dict[int, int] = {}
    stat: dict[int, list[str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            raw = (d / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        parent[int(d.name)] = int(fields[1])
        stat[int(d.name)] = fields
    out: dict[int, list[str]] = {}
    for pid, fields in stat.items():
        p = pid
        while p not in (0, 1, root_pid) and p in parent:
            p = parent[p]
        if p == root_pid:
            out[pid] = fields
    return out


def stack_cpu_s(root_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root_pid``'s descendants, by role.

    Read from ``/proc``: a phase's figure is the difference of two readings
    (a process that ended between them is not counted)."""
    out: dict[str, float] = {}
    for pid, fields in _stack(root_pid).items():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        role = _label(argv)
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


def renice_stack(root_pid: int, api: int | None, nice: int) -> int:
    """Set every thread of every process of the stack but the API to ``nice``
    (a thread or process started later inherits its creator's). The engines,
    workers, Redis and PostgreSQL stand in for other machines: niced, they
    still run, but a waking API thread no longer waits behind them for one of
    the two cores. Returns how many processes were reniced.

    Pinning them to one core and the API to the other was tried first: the
    rest then did not fit on one core during the ramp (59 of 2,000 streams
    served)."""
    n = 0
    for pid in _stack(root_pid):
        if pid == api:
            continue
        with contextlib.suppress(OSError):
            for t in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(t.name), nice)
            n += 1
    return n


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 1) for k in sorted(after)}


def ledger_counts(
    data_dir: Path, since_ts: float, settle_s: float, expect: int = 0
) -> dict[str, int]:
    """Status counts of the ledger rows that arrived since ``since_ts``, once no
    row is ``in_flight`` and ``expect`` rows are there (or after ``settle_s``)."""
    import sqlalchemy as sa

    from tokenfleet.service.config import load_config
    from tokenfleet.service.endpoints import discover

    cfg = load_config(env={}, overrides={"data_dir": str(data_dir)})
    ep = discover(cfg, require=("database",))
    engine = sa.create_engine(str(ep.database_url))
    counts: dict[str, int] = {}
    deadline = time.monotonic() + settle_s
    try:
        while True:
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text(
                        "SELECT status, count(*) FROM requests "
                        "WHERE arrival_ts >= to_timestamp(:t) "
                        "AND request_id NOT LIKE '%:dup:%' GROUP BY status"
                    ),
                    {"t": since_ts},
                ).all()
            counts = {str(s): int(c) for s, c in rows}
            settled = not counts.get("in_flight") and sum(counts.values()) >= expect
            if settled or time.monotonic() > deadline:
                return counts
            time.sleep(2.0)
    finally:
        engine.dispose()


def disconnects(host: str, port: int) -> dict[str, float]:
    """The API's ``tokenfleet_client_disconnects_total`` by how it noticed."""
    import http.client

    try:
        c = http.client.HTTPConnection(host, port, timeout=30)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenfleet_client_disconnects_total{"):
            how = line.split('how="', 1)[1].split('"', 1)[0]
            out[how] = float(line.rsplit(" ", 1)[1])
    return out


def wait_http(host: str, port: int, timeout_s: float) -> None:
    import http.client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            c = http.client.HTTPConnection(host, port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError("tokenfleet up did not become healthy")


def model_name(host: str, port: int) -> str:
    import http.client

    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    return str(json.loads(c.getresponse().read())["data"][0]["id"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(ROOT), help="tree whose `tokenfleet up` runs")
    ap.add_argument("--port", type=int, default=18765)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--time-scale", type=float, default=20.0, help="emulator slow-down")
    ap.add_argument(
        "--engine-nice",
        type=int,
        default=0,
        help="the emulated engines' niceness (tokenfleet up --engine-nice): they stand "
        "in for GPU servers, which do not share the API's cores in production",
    )
    ap.add_argument(
        "--rest-nice",
        type=int,
        default=0,
        help="renice every process of the stack but the API (engines, workers, Redis, "
        "PostgreSQL, beat): the API measured as if the rest ran on other machines",
    )
    ap.add_argument("--slots", type=int, default=1024, help="worker slots, streams phase")
    ap.add_argument("--rate-slots", type=int, default=64, help="worker slots, rates phase")
    ap.add_argument("--streams", default="1000", help="comma list of N concurrent streams")
    ap.add_argument("--ramp-s", type=float, default=5.0)
    ap.add_argument("--stream-tokens", type=int, default=32)
    ap.add_argument("--stream-timeout-s", type=float, default=300.0)
    ap.add_argument("--rates", default="20,50,100", help="comma list of req/s ('' = skip)")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--client-timeout-s", type=float, default=30.0)
    ap.add_argument(
        "--chat-tokens", type=int, default=0, help="rates: output tokens (0: the emulator draws)"
    )
    ap.add_argument("--rate-time-scale", type=float, default=1.0, help="(restart) for rates")
    ap.add_argument("--abandon", type=int, default=20)
    ap.add_argument("--settle-s", type=float, default=120.0)
    ap.add_argument("--admission", default=None, help="up --admission (default: slomax)")
    ap.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for up's processes (repeatable)"
    )
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    if args.out:  # before the run: a missing folder must not lose its results
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    out: dict[str, Any] = {"src": args.src, "args": vars(args)}
    host = "127.0.0.1"
    phases: list[tuple[str, float, int]] = []
    if args.streams:
        phases.append(("streams", args.time_scale, args.slots))
    if args.rates or args.abandon:
        phases.append(("rates", args.rate_time_scale, args.rate_slots))
    for phase, ts, slots in phases:
        with tempfile.TemporaryDirectory(prefix="tf-load-") as tmp:
            data_dir = Path(args.data_dir or tmp) / phase
            data_dir.parent.mkdir(parents=True, exist_ok=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
            env.update(PYTHONPATH=args.src, TOKENFLEET_API_KEY=API_KEY, PYTHONUNBUFFERED="1")
            env.update(kv.split("=", 1) for kv in args.env)
            log = open(data_dir.parent / f"up-{phase}.log", "wb")  # noqa: SIM115
            cmd = [sys.executable, "-m", "tokenfleet.cli.main", "up", "--port", str(args.port)]
            cmd += ["--data-dir", str(data_dir), "--time-scale", str(ts)]
            cmd += ["--slots", str(slots), "--loglevel", "WARNING"]
            if args.engine_nice:
                cmd += ["--engine-nice", str(args.engine_nice)]
            if args.admission:
                cmd += ["--admission", args.admission]
            up = subprocess.Popen(cmd, cwd=args.src, env=env, stdout=log, stderr=log)
            try:
                wait_http(host, args.port, 180)
                model = model_name(host, args.port)
                pid = api_pid(args.port)
                res: dict[str, Any] = {"rss_mib_idle": rss_mib(pid)}
                if args.rest_nice:
                    res["reniced"] = renice_stack(up.pid, pid, args.rest_nice)
                if phase == "streams":
                    for n in [int(x) for x in args.streams.split(",") if x]:
                        since = time.time()
                        cpu0, own0 = stack_cpu_s(up.pid), os.times()
                        r = asyncio.run(
                            run_streams(
                                host,
                                args.port,
                                model,
                                n,
                                args.ramp_s,
                                args.stream_tokens,
                                args.stream_timeout_s,
                            )
                        )
                        own1 = os.times()
                        own_s = own1.user + own1.system - own0.user - own0.system
                        r["cpu_s"] = cpu_delta(cpu0, stack_cpu_s(up.pid))
                        r["cpu_s"]["load_client"] = round(own_s, 1)
                        r["api_rss_mib"] = rss_mib(pid)
                        r["api_threads"] = threads_of(pid)
                        r["api_disconnects"] = disconnects(host, args.port)
                        r["ledger"] = ledger_counts(data_dir, since, args.settle_s, n)
                        res[f"streams_{n}"] = r
                        print(json.dumps({f"streams_{n}": r}), flush=True)
                else:
                    if args.abandon:  # first: on a quiet stack, so its rows are its own
                        since = time.time()
                        asyncio.run(run_abandon(host, args.port, model, args.abandon))
                        res["abandon"] = {
                            "requests": args.abandon,
                            "ledger": ledger_counts(data_dir, since, args.settle_s, args.abandon),
                        }
                        print(json.dumps({"abandon": res["abandon"]}), flush=True)
                    for rate in [float(x) for x in args.rates.split(",") if x]:
                        since = time.time()
                        cpu0 = stack_cpu_s(up.pid)
                        r = asyncio.run(
                            run_rate(
                                host,
                                args.port,
                                model,
                                rate,
                                args.duration_s,
                                args.client_timeout_s,
                                args.chat_tokens,
                            )
                        )
                        r["cpu_s"] = cpu_delta(cpu0, stack_cpu_s(up.pid))
                        r["api_rss_mib"] = rss_mib(pid)
                        r["ledger"] = ledger_counts(data_dir, since, args.settle_s, r["requests"])
                        res[f"rate_{rate:g}"] = r
                        print(json.dumps({f"rate_{rate:g}": r}), flush=True)
                out[phase] = res
            finally:
                up.send_signal(signal.SIGINT)
                try:
                    up.wait(60)
                except subprocess.TimeoutExpired:
                    up.kill()
                log.close()
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
