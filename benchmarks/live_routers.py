"""Live head-to-head: TokenFleet against the Rust routers users pick instead (issue #17).

``python benchmarks/live_routers.py [--slice mooncake|prefix-heavy] [--repeats 3]``

Every run starts fresh emulated engines (``tokenfleet engine-sim``, real decode
speed, vLLM KV events on, each its own process) and one front door in front of
them, then replays the same requests, streamed, at their arrival times
(``tokenfleet.live.bench.replay``); the front doors are interleaved, repeat by
repeat, so a drift of the shared machine's speed hits all of them alike.

Front doors (``--fronts``):

* ``sglang:cache_aware``, ``sglang:round_robin``: ``sglang-router launch`` (PyPI
  ``sglang-router``); it drops ``vllm_xargs``, so its requests carry the
  trace's output length as ``ignore_eos`` + ``max_tokens`` (its policies do
  not read ``max_tokens``);
* ``vllm:cache_aware``, ``vllm:kv_aware``: ``vllm-router`` (PyPI
  ``vllm-router``), ``kv_aware`` fed by the engines' KV events
  (``--kv-event-source``);
* ``tokenfleet:tokenpilot``, ``tokenfleet:round_robin``: the whole live
  service (API process, one Celery worker per engine relaying its KV events,
  Redis, PostgreSQL, beat), SLOMax admission and LiveConfig's timings as
  shipped (before 2026-12-05's section 21 of docs/benchmarks.md, the test
  suite's: scrapes every 0.25 s, control period 0.5 s);
  ``tokenfleet:tokenpilot-noadm``: the same without an admission policy (the
  router alone, as the Rust routers run), ``-pinned_noadm`` also pinned;
  ``tokenfleet:tokenpilot-pinned``: the same with late binding off (every
  request to the routed instance's own queue: ``affinity_min_cached_tokens``
  and ``..._fraction`` 0), as the simulator places requests;
  ``tokenfleet:tokenpilot-hits``: pinned whenever the router expects at
  least ``affinity_min_cached_tokens`` cached (fraction 0), late-bound
  otherwise; ``tokenfleet:tokenpilot-late``: late-bound also when the
  router's choice is idle (``affinity_when_idle`` off, as shipped before
  2026-12-05); ``tokenfleet:tokenpilot-worker``: every attempt through
  the broker and a worker (``express_dispatch`` off, as shipped before
  2026-12-05's second change); ``tokenfleet:tokenpilot-2api``: two API replicas on the same
  stores, the client sending the requests to them in turn (the booking check
  on, as shipped), and ``tokenfleet:tokenpilot-2api_nocheck``: the same with
  ``booking_check`` off. Their rows add the replicas' booking rechecks.

The Rust routers come from PyPI into their own cached virtualenv
(``--routers-venv``, default ``.venv-routers``; created on first use).

Slices: ``mooncake`` is the shared Mooncake trace's first ``--duration``
seconds at ``--rate-scale`` (default 160 s at 0.5: about 316 requests);
``prefix-heavy`` is the synthetic ``conversations`` workload (long multi-turn
sessions on shared system prompts) at ``--rate`` requests/s.

Per run: TTFT p50/p95, goodput (output tokens/s of requests that met their
SLO), SLO attainment, and the front door's own path latency (client send ->
engine, engine first token -> client; joined with the engines' request logs
by the X-Request-Id the front door forwards), and the front door's CPU per
request over the run (gross: background work included; TokenFleet's control
plane as ``cpu_per_request.py`` counts it, or the Rust router's process
tree; engines and the client apart). The table gives the median of
the repeats and their range. ``--dump DIR`` keeps each run's requests as
the client, the engines, the ledger and the simulator saw them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support

from benchmarks.cpu_per_request import CONTROL_PLANE, cpu_by_role, stack_pids, tree_cpu_s  # noqa: E402
from tests.support.stack import API_KEY, InstanceSpec, LiveStack, engine_sim_argv  # noqa: E402
from tests.support.stores import temp_data_dir  # noqa: E402
from tokenfleet.core.tiers import SLOConfig  # noqa: E402
from tokenfleet.live import steps  # noqa: E402
from tokenfleet.live.bench import (  # noqa: E402
    hop_breakdown,
    outcome_traces,
    path_delays,
    replay,
    step_breakdown,
    summary,
)
from tokenfleet.service.embedded import free_port  # noqa: E402
from tokenfleet.workloads.trace import TraceRequest  # noqa: E402

PROFILE = "llama3-8b-h200"
ROUTER_PACKAGES = ("sglang-router==0.3.2", "vllm-router==0.1.17")
DEFAULT_FRONTS = (
    "sglang:cache_aware",
    "vllm:cache_aware",
    "vllm:kv_aware",
    "tokenfleet:tokenpilot",
    "tokenfleet:round_robin",
)
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic.jsonl"
#: the simulator's model of each front door's policy (``--sim``), and whether
#: its engines' KV events reach it as deployed here
SIM_POLICY: dict[str, tuple[str, bool]] = {
    "sglang:cache_aware": ("sglang_cache_aware", False),
    "sglang:round_robin": ("round_robin", False),
    # vllm-router's cache_aware is sglang-router's policy (same defaults but a
    # 2**25-character tree and 120 s eviction, which this slice never reaches)
    "vllm:cache_aware": ("sglang_cache_aware", False),
    "vllm:kv_aware": ("vllm_router_kv_aware", True),
    "vllm:round_robin": ("round_robin", False),
    "tokenfleet:tokenpilot": ("tokenpilot", True),
    "tokenfleet:tokenpilot-pinned": ("tokenpilot", True),
    "tokenfleet:tokenpilot-hits": ("tokenpilot", True),
    "tokenfleet:tokenpilot-late": ("tokenpilot", True),
    "tokenfleet:tokenpilot-worker": ("tokenpilot", True),
    "tokenfleet:tokenpilot-2api": ("tokenpilot", True),
    "tokenfleet:tokenpilot-2api_nocheck": ("tokenpilot", True),
    "tokenfleet:tokenpilot-noadm": ("tokenpilot", True),
    "tokenfleet:tokenpilot-pinned_noadm": ("tokenpilot", True),
    "tokenfleet:tokenpilot-nohold": ("tokenpilot", True),
    "tokenfleet:round_robin": ("round_robin", False),
}
#: live settings of a ``tokenfleet:`` front's variant (``POLICY-VARIANT``)
VARIANTS: dict[str, dict[str, Any]] = {
    "pinned": {"affinity_min_cached_tokens": 0, "affinity_min_cached_fraction": 0.0},
    # pinned when the router expects any real cache hit there, late-bound otherwise
    "hits": {"affinity_min_cached_fraction": 0.0},
    # as shipped before 2026-12-05: an idle choice without a cache hit went to the pool too
    "late": {"affinity_when_idle": False},
    # as shipped before express dispatch: every attempt a Celery task for a worker
    "worker": {"express_dispatch": False},
    "2api": {},
    # the API's interpreter switch interval at 0.2 ms, not 1: the path no
    # shorter (docs/benchmarks.md, section 35)
    "sw02": {"api_switch_interval_ms": 0.2},
    "2api_nocheck": {"booking_check": False},
    "noadm": {},  # no admission policy: the router alone, as the Rust routers run
    "pinned_noadm": {"affinity_min_cached_tokens": 0, "affinity_min_cached_fraction": 0.0},
    # as shipped before 2026-12-06: a request admission queues is routed at once
    "nohold": {"api_hold_queued": False},
}
#: variants without SLOMax in front of the router
NO_ADMISSION = {"noadm", "pinned_noadm"}
SIM_DRAWS = 4


# ---- the requests -------------------------------------------------------------------------
def load_slice(args: argparse.Namespace, model: str) -> list[TraceRequest]:
    if args.slice == "mooncake":
        from tokenfleet.workloads import load_workload
        from tokenfleet.workloads.scaling import rate_scale

        if not TRACE.exists():
            raise SystemExit(f"the mooncake slice needs {TRACE} (see ../shared/traces/README)")
        reqs = rate_scale(load_workload(str(TRACE), "mooncake", model=model), args.rate_scale)
    else:
        from tokenfleet.workloads.synthetic import SYNTHETIC

        n = int(args.rate * args.duration * 1.2) + 10
        reqs = SYNTHETIC.get("conversations")(n, args.seed, args.rate, model=model)
    t0 = reqs[0].info.arrival_s
    return [r for r in reqs if r.info.arrival_s - t0 < args.duration]


# ---- processes ------------------------------------------------------------------------------
class Engines:
    """``n`` fresh ``tokenfleet engine-sim`` processes with KV events and request logs."""

    def __init__(self, n: int, log_dir: Path, seed: int) -> None:
        self.log_dir = log_dir
        self.urls: list[str] = []
        self.kv: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for k in range(n):
                self._start(k, seed)
            for k in range(n):
                if not self._healthy(k, 60.0):
                    # a port taken between free_port() and the bind, or a slow
                    # start: once more on fresh ports before giving up
                    _stop([self.procs[k]])
                    self._start(k, seed)
                    if not self._healthy(k, 60.0):
                        tail = (log_dir / f"engine-{k}.log").read_text(errors="replace")[-1500:]
                        raise TimeoutError(f"engine {k} did not start twice; its log:\n{tail}")
        except BaseException:
            self.stop()
            raise

    def _start(self, k: int, seed: int) -> None:
        port, kv_port = free_port(), free_port()
        env = dict(os.environ, TOKENFLEET_EMULATOR_REQUEST_LOG=str(self.log_dir / f"e{k}.jsonl"))
        argv = engine_sim_argv(
            port,
            PROFILE,
            seed=seed + k + 1,
            extra=["--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}"],
        )
        log = open(self.log_dir / f"engine-{k}.log", "ab")  # noqa: SIM115 - closed by the process
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        url, kv = f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{kv_port}"
        if k < len(self.procs):
            self.procs[k], self.urls[k], self.kv[k] = proc, url, kv
        else:
            self.procs.append(proc)
            self.urls.append(url)
            self.kv.append(kv)

    def _healthy(self, k: int, timeout_s: float) -> bool:
        """Engine ``k`` answers ``/health`` in time (False at once if it exited)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.procs[k].poll() is not None:
                return False
            try:
                _wait_http(self.urls[k] + "/health", 1.0)
                return True
            except TimeoutError:
                pass
        return False

    def stop(self) -> None:
        _stop(self.procs)


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout_s:.0f} s")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def routers_venv(path: Path) -> Path:
    """The virtualenv with the Rust routers (made once, from PyPI)."""
    marker = path / ".installed"
    if not marker.exists():
        print(f"installing {', '.join(ROUTER_PACKAGES)} into {path} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(path / "bin" / "pip"), "install", *ROUTER_PACKAGES], check=True)
        marker.touch()
    return path / "bin"


def start_rust_router(
    kind: str, policy: str, engines: Engines, bin_dir: Path, log_dir: Path
) -> tuple[str, subprocess.Popen[bytes]]:
    port, metrics_port = free_port(), free_port()
    common = [
        "--worker-urls",
        *engines.urls,
        "--policy",
        policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(metrics_port),
        "--request-id-headers",
        "x-request-id",
    ]
    if kind == "sglang":
        argv = [str(bin_dir / "sglang-router"), "launch", *common]
    else:
        argv = [str(bin_dir / "vllm-router"), *common]
        if policy == "kv_aware":
            # the engines' events, the model they serve, and their block size
            # (the emulator's 16 tokens; the router tokenizes via POST /tokenize)
            argv += ["--kv-event-model", _model(engines.urls[0]), "--kv-event-block-size", "16"]
            for url, kv in zip(engines.urls, engines.kv, strict=True):
                argv += ["--kv-event-source", f"{url}={kv}"]
    log = open(log_dir / f"{kind}-{policy}.log", "wb")  # noqa: SIM115 - closed by the process
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/v1/models", 60)
    except TimeoutError:
        proc.kill()
        tail = (log_dir / f"{kind}-{policy}.log").read_text(errors="replace")[-1500:]
        raise TimeoutError(f"{kind}-router --policy {policy} did not start:\n{tail}") from None
    return url, proc


# ---- one run ----------------------------------------------------------------------------
def one_run(
    front: str, reqs: list[TraceRequest], args: argparse.Namespace, bin_dir: Path, rep: int
) -> dict[str, Any]:
    kind, policy = front.split(":", 1)
    slo = SLOConfig()
    with temp_data_dir("tokenfleet-routers-") as d:
        logs = d / "engine-requests"
        logs.mkdir()
        engines = Engines(args.engines, logs, seed=100 * rep)
        stack: LiveStack | None = None
        proc: subprocess.Popen[bytes] | None = None
        hops: dict[str, dict[str, float]] | None = None
        step_ms: dict[str, dict[str, float]] | None = None
        step_dir = d / "api-steps"
        try:
            hook = None
            if kind == "tokenfleet":
                policy, _, variant = policy.partition("-")
                stack = LiveStack(
                    data_dir=d,
                    instances=[
                        InstanceSpec("dc-a", f"e{k}", slots=64) for k in range(args.engines)
                    ],
                    router=policy,
                    admission=front_admission(front) or "none",
                    with_beat=True,  # as `tokenfleet up`: SLOMax's knobs follow the traffic
                    external_engines=True,
                    engine_urls={f"e{k}": u for k, u in enumerate(engines.urls)},
                    kv_endpoints={f"e{k}": kv for k, kv in enumerate(engines.kv)},
                    engines_in_process=False,
                    api_in_process=False,
                    api_env={steps.ENV: str(step_dir)} if args.steps else {},
                    # as `tokenfleet up` runs it (0.5 s scrapes, 5 s control
                    # period), not the test suite's faster timings
                    test_timings=False,
                    live_overrides={
                        "fleet_policy": "off",
                        "request_timeout_s": 300.0,
                        **VARIANTS.get(variant, {}),
                    },
                )
                step_dir.mkdir()
                stack.start()
                urls = [stack.url]
                if variant.startswith("2api"):
                    urls.append(stack.start_api_process("api-2"))
            else:
                url, proc = start_rust_router(kind, policy, engines, bin_dir, d)
                urls = [url]
                if kind == "sglang":

                    def hook(body: dict[str, Any], req: TraceRequest) -> None:
                        body["ignore_eos"] = True
                        body["max_tokens"] = max(1, req.output_tokens)

            cpu0 = _front_cpu_s(stack, proc)
            outs, wall_s = replay(
                urls,
                API_KEY,
                reqs,
                model=_model(engines.urls[0]),  # what a front door reports varies
                slo=slo,
                send_request_ids=True,
                body_hook=hook,
            )
            front_cpu_s = _front_cpu_s(stack, proc) - cpu0
            rechecks = booking_rechecks(urls) if kind == "tokenfleet" else None
            if args.dump is not None:
                dump_run(args.dump / f"{front}-{rep}", outs, logs, stack)
            if stack is not None and args.breakdown:
                hops = hop_breakdown(
                    outcome_traces(outs),
                    stack.ledger_rows(timeout_s=5.0),
                    stack.gateway.state.request_state,
                    logs,
                )
            if stack is not None and args.steps:
                step_ms = step_breakdown(outcome_traces(outs), steps.read_steps(step_dir), logs)
        finally:
            if stack is not None:
                stack.stop()
            if proc is not None:
                _stop([proc])
            engines.stop()
        s = summary(outs, wall_s, slo)
        delays = path_delays(outs, logs)
        sim = simulate(front, reqs, args, outs, logs, rep) if args.sim else None
    path_ms = sorted(1000.0 * (disp + relay) for _, disp, relay in delays)
    dispatch_ms = sorted(1000.0 * disp for _, disp, _ in delays)
    return {
        "front": front,
        "repeat": rep,
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p95_s": s["ttft_p95_s"],
        "goodput_tok_s": s["goodput_tok_s"],
        "slo_attainment": s["slo_attainment"],
        "path_p50_ms": _q(path_ms, 0.5),
        "dispatch_p50_ms": _q(dispatch_ms, 0.5),
        "dispatch_p95_ms": _q(dispatch_ms, 0.95),
        "front_cpu_ms_per_request": round(front_cpu_s * 1e3 / max(1, len(outs)), 2),
        "joined": len(delays),
        "requests": len(outs),
        "failed": sum(o.status != "completed" for o in outs),
        "sample_errors": s.get("sample_errors", []),
        "booking_rechecks": rechecks,
        "hops": hops,
        "steps": step_ms,
        "sim": sim,
    }


def _front_cpu_s(stack: LiveStack | None, proc: subprocess.Popen[bytes] | None) -> float:
    """CPU seconds the front door's processes have used: TokenFleet's control
    plane (API, workers, beat, Redis, PostgreSQL; ``cpu_per_request.py``'s
    roles) or the Rust router's process tree. Engines and this client are not
    counted."""
    if stack is not None:
        by_role = cpu_by_role(stack_pids(stack))
        return sum(by_role.get(r, 0.0) for r in CONTROL_PLANE)
    if proc is not None:
        return tree_cpu_s(proc.pid) or 0.0
    return 0.0


def booking_rechecks(urls: list[str]) -> dict[str, float]:
    """``tokenfleet_booking_rechecks_total`` summed over the API replicas, by
    whether the request moved."""
    out: dict[str, float] = {"moved": 0.0, "stayed": 0.0}
    for url in urls:
        req = urllib.request.Request(
            url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("tokenfleet_booking_rechecks_total{"):
                moved = 'moved="true"' in line
                out["moved" if moved else "stayed"] += float(line.rsplit(" ", 1)[1])
    return out


def front_admission(front: str) -> str:
    """The admission policy a front door runs ("" for none): TokenFleet's runs
    SLOMax in front of its router unless its variant turns admission off."""
    kind, rest = front.split(":", 1)
    variant = rest.partition("-")[2]
    return "slomax" if kind == "tokenfleet" and variant not in NO_ADMISSION else ""


def sim_requests(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """The replayed requests as the simulator should see them. Its pool serves
    the model "default". The replay sends each turn with the workload's own
    answer text, which no engine generated, so no engine holds that answer's
    KV; the simulated engines are not told it either (``output_block_hashes``:
    a real client sends the model's own answer back and hits it, as the
    simulator's conversations assume, but that is not what the replay does;
    docs/benchmarks.md section 18)."""
    return [
        dataclasses.replace(
            r, info=dataclasses.replace(r.info, model="default"), output_block_hashes=()
        )
        for r in reqs
    ]


def simulate(
    front: str,
    reqs: list[TraceRequest],
    args: argparse.Namespace,
    outs: Any,
    logs: Path,
    rep: int = 0,
) -> dict[str, Any] | None:
    """The simulator's prediction for this run: the same requests and engines,
    the front door's policy as the simulator models it, and the path latency
    measured in this very run (the mean over ``SIM_DRAWS`` seeded draws of it,
    as tests/test_live_agreement.py does)."""
    from tokenfleet.core.routing import ROUTERS
    from tokenfleet.engine.profiles import get_profile
    from tokenfleet.live.bench import path_latency
    from tokenfleet.sim.runner import SimSettings, run_policies

    policy, kv_events = SIM_POLICY.get(front, ("", False))
    if policy not in ROUTERS:
        return None
    latency = path_latency(outs, logs)
    adm = front_admission(front)  # the simulator runs the same pair
    admissions = [adm] if adm else []
    sim_reqs = sim_requests(reqs)
    runs = [
        run_policies(
            sim_reqs,
            [policy],
            SimSettings(
                profile=get_profile(PROFILE),
                instances=args.engines,
                scrape_interval_s=0.5,  # TokenFleet's live scrape period
                kv_events=kv_events,
                path_latency=latency,
                seed=k,
            ),
            admissions=admissions,
        )[0]
        for k in range(SIM_DRAWS)
    ]
    draws = [r.summary for r in runs]
    if args.dump is not None:
        _jsonl(
            args.dump / f"{front}-{rep}" / "sim.jsonl",
            (dataclasses.asdict(x) for x in runs[0].records),
        )
    return {
        "policy": "+".join([policy, *admissions]),
        "ttft_p50_s": statistics.fmean(float(d["ttft_p50_s"]) for d in draws),
        "ttft_p95_s": statistics.fmean(float(d["ttft_p95_s"]) for d in draws),
    }


def _jsonl(path: Path, rows: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")


def dump_run(out: Path, outs: Any, logs: Path, stack: LiveStack | None) -> None:
    """``--dump``: per request, what the client saw, the engines' logs (one file
    per engine) and, for TokenFleet, its ledger rows: to compare runs request by
    request, and with the simulator's records (``sim.jsonl``, first draw)."""
    _jsonl(
        out / "client.jsonl",
        (
            {
                "request_id": o.request.info.request_id,
                "api_request_id": o.api_request_id,
                "input_tokens": o.request.info.input_tokens,
                "output_tokens": o.output_tokens,
                "sent_s": o.sent_s,
                "sent_wall": o.sent_wall,
                "ttft_s": None if o.first_token_s is None else o.first_token_s - o.sent_s,
                "status": o.status,
                "cached_tokens": o.cached_tokens,
            }
            for o in outs
        ),
    )
    (out / "engines").mkdir(parents=True, exist_ok=True)
    for f in logs.glob("*.jsonl"):
        shutil.copy(f, out / "engines" / f.name)
    if stack is not None:
        _jsonl(out / "ledger.jsonl", stack.ledger_rows(timeout_s=5.0))


def _model(url: str) -> str:
    req = urllib.request.Request(url + "/v1/models")
    req.add_header("Authorization", f"Bearer {API_KEY}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


def _q(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


# ---- the table --------------------------------------------------------------------------
def table(runs: list[dict[str, Any]], fronts: list[str]) -> str:
    cols = [
        ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
        ("TTFT p95 s", "ttft_p95_s", "{:.3f}"),
        ("goodput tok/s", "goodput_tok_s", "{:.0f}"),
        ("SLO met", "slo_attainment", "{:.1%}"),
        ("path p50 ms", "path_p50_ms", "{:.1f}"),
        ("dispatch p95 ms", "dispatch_p95_ms", "{:.1f}"),
        ("front CPU ms/req", "front_cpu_ms_per_request", "{:.1f}"),
    ]
    lines = ["| front door | " + " | ".join(c[0] for c in cols) + " |"]
    lines.append("|" + " --- |" * (len(cols) + 1))
    for f in fronts:
        mine = [r for r in runs if r["front"] == f]
        if not mine:  # every run of it failed
            continue
        cells = []
        for _, key, fmt in cols:
            xs = [r[key] for r in mine]
            med = statistics.median(xs)
            cells.append(
                fmt.format(med)
                + (f" ({fmt.format(min(xs))}-{fmt.format(max(xs))})" if len(xs) > 1 else "")
            )
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    for r in runs:
        b = r.get("booking_rechecks")
        if b and "2api" in r["front"]:
            n = b["moved"] + b["stayed"]
            lines.append(
                f"{r['front']} repeat {r['repeat']}: booking rechecks {n:.0f}"
                f" (moved {b['moved']:.0f})"
            )
    return "\n".join(lines)


def sim_table(runs: list[dict[str, Any]], fronts: list[str]) -> str:
    """Live vs the simulator's model of the same front door (medians of the repeats)."""
    lines = [
        "| front door | sim policy | TTFT p50 live / sim (sim/live) "
        "| TTFT p95 live / sim (sim/live) |",
        "| --- | --- | --- | --- |",
    ]
    for f in fronts:
        mine = [r for r in runs if r["front"] == f and r["sim"]]
        if not mine:
            continue
        cells = []
        for key in ("ttft_p50_s", "ttft_p95_s"):
            live = statistics.median(r[key] for r in mine)
            sim = statistics.median(r["sim"][key] for r in mine)
            cells.append(f"{live:.3f} / {sim:.3f} ({sim / live:.2f})")
        lines.append(f"| {f} | {mine[0]['sim']['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slice", choices=["mooncake", "prefix-heavy"], default="mooncake")
    ap.add_argument("--fronts", default=",".join(DEFAULT_FRONTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--duration", type=float, default=None, help="seconds of the slice")
    ap.add_argument("--rate-scale", type=float, default=0.5, help="mooncake slice")
    ap.add_argument("--rate", type=float, default=6.5, help="prefix-heavy slice, requests/s")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--routers-venv", type=Path, default=ROOT / ".venv-routers")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--sim", action="store_true", help="also the simulator's prediction of each run"
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="TokenFleet fronts: also the median and p90 of every hop of its path",
    )
    ap.add_argument(
        "--steps",
        action="store_true",
        help="TokenFleet fronts: also the median and p90 of every step inside the API "
        "up to the first token (tokenfleet/live/steps.py), for requests it sent the engine itself",
    )
    ap.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="write each run's per-request data (client, engines, ledger, simulator) here",
    )
    args = ap.parse_args()
    if args.duration is None:
        args.duration = 160.0 if args.slice == "mooncake" else 120.0
    fronts = [f.strip() for f in args.fronts.split(",") if f.strip()]
    for f in fronts:
        kind, _, policy = f.partition(":")
        if kind not in ("sglang", "vllm", "tokenfleet") or not policy:
            raise SystemExit(f"--fronts: '{f}' is not KIND:POLICY with KIND sglang|vllm|tokenfleet")
    bin_dir = routers_venv(args.routers_venv)
    reqs = load_slice(args, "meta-llama/Llama-3.1-8B-Instruct")
    mean_in = statistics.fmean(r.info.input_tokens for r in reqs)
    print(
        f"slice {args.slice}: {len(reqs)} requests over {args.duration:g} s, "
        f"mean prompt {mean_in:.0f} tokens; {args.engines} engines; "
        f"{len(fronts)} front doors x {args.repeats} repeats",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    failed_runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for f in fronts:
            t0 = time.monotonic()
            try:
                r = one_run(f, reqs, args, bin_dir, rep)
            except Exception as exc:  # noqa: BLE001 - one broken run must not lose the others
                print(f"  [{rep + 1}/{args.repeats}] {f:24} FAILED: {exc}", flush=True)
                failed_runs.append({"front": f, "repeat": rep, "error": str(exc)})
                continue
            runs.append(r)
            if r["ttft_p50_s"] is None:
                raise SystemExit(f"{f}: no request completed; errors: {r['sample_errors']}")
            print(
                f"  [{rep + 1}/{args.repeats}] {f:24} TTFT p50 {r['ttft_p50_s']:.3f} "
                f"p95 {r['ttft_p95_s']:.3f} s, goodput {r['goodput_tok_s']:.0f} tok/s, "
                f"SLO {r['slo_attainment']:.1%}, path p50 {r['path_p50_ms']:.1f} ms, "
                f"front CPU {r['front_cpu_ms_per_request']:.1f} ms/req "
                f"({r['joined']}/{r['requests']} joined, {r['failed']} not completed) "
                f"[{time.monotonic() - t0:.0f} s]",
                flush=True,
            )
            for name, h in (r["hops"] or {}).items():
                print(f"      {name:34} p50 {h['p50_ms']:7.2f} ms  p90 {h['p90_ms']:7.2f} ms")
            for name, h in (r["steps"] or {}).items():
                print(
                    f"      {name:44} p50 {h['p50_ms']:7.3f} ms  p90 {h['p90_ms']:7.3f} ms"
                    f"  (n={h['n']})"
                )
    print()
    print(table(runs, fronts))
    if args.sim:
        print()
        print(sim_table(runs, fronts))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(
            json.dumps({"config": config, "runs": runs, "failed": failed_runs}, indent=2)
        )
    if failed_runs:
        print(f"\n{len(failed_runs)} run(s) failed (left out of the tables above)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
