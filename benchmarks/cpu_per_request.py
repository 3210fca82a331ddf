"""CPU-milliseconds per request of every control-plane process, at real prompt
lengths (``python benchmarks/cpu_per_request.py``; issue #23).

A live stack with every process separate (API, one Celery worker per engine,
beat, Redis, PostgreSQL; emulated ``llama3-8b-h200`` engines as their own
processes), the default router (TokenPilot) and admission (SLOMax), and
LiveConfig's default periods (scrapes, beat, leases). For each
configuration -- prompt length (default 1k, 8k and 32k tokens, 70 % of it a
prefix shared by all requests, the rest unique), streamed or not, engines'
vLLM KV events relayed or not -- it sends ``--requests`` chat completions,
open loop at ``--rate`` req/s, each forced to 256 output tokens
(``vllm_xargs.output_tokens``), and reads user + system CPU of every process
(and its children: PostgreSQL's backends) from ``/proc`` before and after.

The engines run at real decode speed by default (``--time-scale 1``): at a
fast scale several tokens land in one read of the engine's stream, how many
depending on how late the worker is, so per-token costs shrink with the
machine's speed.

Why CPU and not latency: on a shared 2-core machine latency moves with the
host's load, CPU time much less; and every CPU-ms the control plane spends is
an ms the engines' neighbours (or the other processes of the path) wait.

Printed per configuration: CPU-ms per request per role (``api``, ``worker``,
``beat``, ``redis``, ``postgres``, the sum as ``control plane``; ``engines``
and this ``client`` apart, not in the sum), ``gross`` (everything the
processes used while the requests ran, divided by the requests) and ``net``
(less what the same processes use idle over the same time, measured first:
scrapes, heartbeats, refresh threads). Background work costs per second, not
per request, so ``gross`` falls as ``--rate`` rises. Below that line, the
API's gross CPU per request by thread role, its six largest (the API's
``tokenfleet_api_thread_cpu_seconds_total``: ``CP Server`` is the HTTP
server's pool, where the requests run; ``stream-pump`` carries the streams).
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

from benchmarks.live_overhead import wakeup_rtt_us
from tests.support.stack import API_KEY, InstanceSpec, LiveStack
from tokenfleet.live.httpclient import KeepAliveClient

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
#: roles summed into the control plane's figure (engines and the client are not)
CONTROL_PLANE = ("api", "worker", "beat", "redis", "postgres")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid``, its reaped children (cutime, cstime)
    and its live descendants: PostgreSQL forks a backend per connection."""
    fields = _stat(pid)
    if fields is None:
        return None
    total = sum(int(fields[i]) for i in (11, 12, 13, 14)) * _TICK_S
    for child in _children(pid):
        total += tree_cpu_s(child) or 0.0
    return total


def role_of(name: str) -> str:
    for prefix in ("worker", "engine"):
        if name.startswith(prefix):
            return prefix + "s" if prefix == "engine" else prefix
    return name


def stack_pids(stack: LiveStack) -> dict[str, int]:
    """Every process of the stack by name (api, beat, worker-*, engine-*, redis,
    postgres) and this process as ``client``."""
    pids = {"client": os.getpid()}
    assert stack.sup is not None
    for name, child in stack.sup.children.items():
        if child.pid is not None:
            pids[name] = child.pid
    if stack.redis is not None and stack.redis.pid:
        pids["redis"] = stack.redis.pid
    if stack.postgres is not None:
        pm = Path(stack.postgres.pgdata) / "postmaster.pid"
        pids["postgres"] = int(pm.read_text().split()[0])
    return pids


def cpu_by_role(pids: dict[str, int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, pid in pids.items():
        # the client's own children: the wake-up probe, not part of any load
        s = tree_cpu_s(pid) if name != "client" else _self_cpu_s()
        if s is not None:
            out[role_of(name)] = out.get(role_of(name), 0.0) + s
    return out


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class _Caller(KeepAliveClient):
    """Reads every answer to its end, so the keep-alive connection is reusable
    (``read1`` at a Content-Length end does not release an ``http.client`` response)."""

    def call(self, body: dict[str, Any]) -> int:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
        try:
            resp = self.request(
                "POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=headers
            )
            data = resp.read()
        except Exception:
            self.drop()
            raise
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:120]!r}")
        return len(data)


def redis_commands(stack: LiveStack) -> dict[str, tuple[int, int]]:
    """Redis ``INFO commandstats``: command -> (calls, CPU microseconds)."""
    import redis

    r = redis.Redis.from_url(stack.redis.url)
    try:
        stats = r.info("commandstats")
    finally:
        r.close()
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


def api_thread_cpu_s(url: str) -> dict[str, float]:
    """The API's CPU seconds by thread role, from its ``/metrics``
    (``tokenfleet_api_thread_cpu_seconds_total``); empty if it has none."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "tokenfleet_api_thread_cpu_seconds":
            for sample in fam.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["thread"]] = sample.value
    return out


def make_prompt(prompt_tokens: int, shared_fraction: float, i: int) -> list[dict[str, str]]:
    """Chat messages of about ``prompt_tokens`` byte-tokenizer tokens (4 bytes
    each); the system message, ``shared_fraction`` of it, is the same for every
    request, the user message differs from its first bytes."""
    shared = int(prompt_tokens * shared_fraction) * 4
    unique = max(8, prompt_tokens * 4 - shared - 40)
    base = "the fleet routes tokens across many engines while cache blocks stay warm. "
    system = (base * (shared // len(base) + 1))[:shared]
    head = f"request {i:08d} {time.time_ns()} "
    user = (head + "quiet queues decode quickly under load. " * (unique // 40 + 1))[:unique]
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def run_config(
    stack: LiveStack,
    *,
    prompt_tokens: int,
    stream: bool,
    requests: int,
    rate_rps: float,
    output_tokens: int,
    shared_fraction: float,
    idle_rate: dict[str, float],
) -> dict[str, Any]:
    client = _Caller(stack.url, timeout_s=120)
    base: dict[str, Any] = {
        "model": stack.model,
        "stream": stream,
        "max_tokens": output_tokens,
        "vllm_xargs": {"output_tokens": output_tokens},
    }
    if stream:
        base["stream_options"] = {"include_usage": True}
    bodies = [
        dict(base, messages=make_prompt(prompt_tokens, shared_fraction, i))
        for i in range(-3, requests)
    ]
    errors: dict[str, int] = {}
    lock = threading.Lock()

    def one(body: dict[str, Any]) -> None:
        try:
            client.call(body)
        except Exception as exc:  # noqa: BLE001
            with lock:
                key = f"{exc.__class__.__name__}: {str(exc)[:80]}"
                errors[key] = errors.get(key, 0) + 1

    for body in bodies[:3]:  # warm: the shared prefix is cached, connections open
        one(body)
    time.sleep(1.0)
    pids = stack_pids(stack)
    before = cpu_by_role(pids)
    cmds0 = redis_commands(stack)
    threads0 = api_thread_cpu_s(stack.url)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=64) as pool:
        for k, body in enumerate(bodies[3:]):
            delay = t0 + k / rate_rps - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, body)
    time.sleep(0.5)  # KV events, ledger flushes and accounting after the last end
    window_s = time.monotonic() - t0
    after = cpu_by_role(pids)
    cmds1 = redis_commands(stack)
    threads1 = api_thread_cpu_s(stack.url)
    used = {r: after[r] - before[r] for r in after if r in before}
    thread_s = {role: s - threads0.get(role, 0.0) for role, s in threads1.items()}
    api_threads = {
        role: round(s * 1e3 / requests, 2)
        for role, s in sorted(thread_s.items(), key=lambda kv: -kv[1])
        if s > 0
    }
    redis_per_request = {
        cmd: {
            "calls": round((calls - cmds0.get(cmd, (0, 0))[0]) / requests, 1),
            "cpu_us": round((us - cmds0.get(cmd, (0, 0))[1]) / requests, 1),
        }
        for cmd, (calls, us) in sorted(cmds1.items(), key=lambda kv: -kv[1][1])
        if calls - cmds0.get(cmd, (0, 0))[0] >= requests / 2
    }
    gross = {r: round(s * 1e3 / requests, 2) for r, s in sorted(used.items())}
    net = {
        r: round((s - idle_rate.get(r, 0.0) * window_s) * 1e3 / requests, 2)
        for r, s in sorted(used.items())
    }
    for d in (gross, net):
        d["control plane"] = round(sum(d.get(r, 0.0) for r in CONTROL_PLANE), 2)
    return {
        "prompt_tokens": prompt_tokens,
        "stream": stream,
        "requests": requests,
        "errors": errors,
        "window_s": round(window_s, 2),
        "gross_cpu_ms_per_request": gross,
        "net_cpu_ms_per_request": net,
        "redis_commands_per_request": redis_per_request,
        "api_thread_cpu_ms_per_request": api_threads,
    }


def idle_cpu_rate(stack: LiveStack, seconds: float) -> dict[str, float]:
    """CPU seconds per second each role uses with no requests."""
    pids = stack_pids(stack)
    before = cpu_by_role(pids)
    time.sleep(seconds)
    after = cpu_by_role(pids)
    return {r: (after[r] - before[r]) / seconds for r in after if r in before}


def run_stack(args: argparse.Namespace, kv_events: bool) -> dict[str, Any]:
    from tests.support.stores import temp_data_dir

    out: dict[str, Any] = {"kv_events": kv_events, "configs": []}
    with temp_data_dir("tokenfleet-cpu-") as d:
        specs = [InstanceSpec("dc-a", f"a{i}", slots=32) for i in range(args.engines)]
        stack = LiveStack(
            data_dir=d,
            instances=specs,
            with_postgres=True,
            with_beat=True,
            time_scale=args.time_scale,
            router="tokenpilot",
            admission="slomax",
            engines_in_process=False,
            api_in_process=False,
            engine_kv_events=kv_events,
            # LiveConfig's periods (scrapes, control, leases), not the test
            # suite's shorter ones: background work costs per second, so test
            # periods would overstate it
            test_timings=False,
            live_overrides=dict(args.live or []),
        )
        stack.start()
        try:
            time.sleep(2.0)  # let start-up work (imports, first scrapes) finish
            idle = idle_cpu_rate(stack, args.idle_s)
            out["idle_cpu_ms_per_s"] = {r: round(v * 1e3, 2) for r, v in sorted(idle.items())}
            for prompt_tokens in args.prompt_tokens:
                for stream in args.stream_modes:
                    res = run_config(
                        stack,
                        prompt_tokens=prompt_tokens,
                        stream=stream,
                        requests=args.requests,
                        rate_rps=args.rate,
                        output_tokens=args.output_tokens,
                        shared_fraction=args.shared_fraction,
                        idle_rate=idle,
                    )
                    res["kv_events"] = kv_events
                    out["configs"].append(res)
                    print(_line(res), file=sys.stderr, flush=True)
        finally:
            stack.stop()
    return out


def _line(res: dict[str, Any]) -> str:
    g, n = res["gross_cpu_ms_per_request"], res["net_cpu_ms_per_request"]
    roles = " ".join(f"{r}={g.get(r, 0):.2f}" for r in (*CONTROL_PLANE, "engines", "client"))
    threads = " ".join(
        f"{t}={v:.2f}" for t, v in list(res["api_thread_cpu_ms_per_request"].items())[:6]
    )
    return (
        f"prompt={res['prompt_tokens']:>6} stream={int(res['stream'])} kv={int(res['kv_events'])} "
        f"control plane gross={g['control plane']:.2f} net={n['control plane']:.2f} ms/req | "
        f"{roles} | errors={sum(res['errors'].values())}\n"
        f"    api by thread (gross ms/req): {threads}"
    )


def _live_setting(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument(
        "--stream", choices=("both", "yes", "no"), default="both", help="streamed requests or not"
    )
    p.add_argument(
        "--kv-events", choices=("both", "on", "off"), default="both", help="engines' KV events"
    )
    p.add_argument("--requests", type=int, default=40, help="per configuration")
    p.add_argument("--rate", type=float, default=5.0, help="open-loop requests per second")
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--shared-fraction", type=float, default=0.7)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="emulated engine time scale (1: real decode speed; faster scales let tokens pile up"
        " between reads, so they understate per-token costs by an amount that follows the"
        " machine's speed)",
    )
    p.add_argument("--idle-s", type=float, default=5.0, help="idle measurement before the load")
    p.add_argument(
        "--live",
        type=_live_setting,
        action="append",
        metavar="NAME=VALUE",
        help="a LiveConfig override for the stack, e.g. relay_flush_interval_s=0 (repeatable)",
    )
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.json:  # before the run: a missing folder must not lose its results
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    args.stream_modes = {"both": [False, True], "yes": [True], "no": [False]}[args.stream]
    kv_modes = {"both": [False, True], "on": [True], "off": [False]}[args.kv_events]
    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "stream_modes"},
        "machine_wakeup_rtt_us": wakeup_rtt_us(),
        "stacks": [run_stack(args, kv) for kv in kv_modes],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
