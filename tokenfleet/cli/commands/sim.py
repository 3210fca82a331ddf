"""``tokenfleet sim``: replay a workload against policies and compare them.

``tokenfleet sim sweep`` repeats the comparison over several loads and plots
TTFT against load.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tokenfleet.errors import ConfigError, TokenFleetError

DEFAULT_POLICIES = ["round_robin", "llmd_weighted", "sglang_cache_aware", "dynamo_kv"]
#: every router of tokenfleet.core.routing.ROUTERS, for --help without importing the
#: routers on every CLI call (a test keeps the two equal)
ROUTER_NAMES = (
    "tokenpilot",
    "round_robin",
    "random",
    "least_requests",
    "llmd_weighted",
    "sglang_cache_aware",
    "dynamo_kv",
    "vllm_router_kv_aware",
    # prefill/decode disaggregation: the pool runs two-phase requests (sim/pd.py)
    "tokenpilot_pd",
    "tokenpilot_pd_shed",
    "dynamo_disagg",
    "llmd_pd",
)


def _positive_float(name: str, allow_zero: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got '{text}'") from None
        if not (v >= 0 if allow_zero else v > 0) or v == float("inf"):
            raise argparse.ArgumentTypeError(
                f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {text}"
            )
        return v

    return parse


def _positive_int(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got '{text}'") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {text}")
        return v

    return parse


def add_common_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("workload")
    src.add_argument("--trace", metavar="FILE", help="trace file to replay")
    src.add_argument(
        "--trace-format",
        choices=["mooncake", "azure", "tokenfleet"],
        help="trace format (default: guessed from the file)",
    )
    src.add_argument(
        "--synthetic",
        metavar="NAME",
        help="built-in synthetic workload instead of a trace (e.g. chat, mixed)",
    )
    src.add_argument(
        "--synthetic-requests",
        type=_positive_int("--synthetic-requests"),
        default=2000,
        metavar="N",
        help="requests to generate (default 2000)",
    )
    src.add_argument(
        "--limit", type=_positive_int("--limit"), metavar="N", help="use only the first N requests"
    )
    src.add_argument(
        "--workload",
        metavar="FILE.yaml",
        help="mixed workload: request classes from traces or generators, each "
        "with its own tier, rate, tenant, max_tokens, deadline or timeout "
        "(e.g. examples/scenarios/mixed.yaml); --load/--rate-scale scale "
        "its streams, jobs stay as given",
    )
    rate = src.add_mutually_exclusive_group()
    rate.add_argument(
        "--load",
        type=_positive_float("--load"),
        metavar="F",
        help="scale arrivals so offered work = F x cluster capacity",
    )
    rate.add_argument(
        "--rate-scale",
        type=_positive_float("--rate-scale"),
        metavar="X",
        help="compress time: X=2 replays twice as fast",
    )
    cl = p.add_argument_group("cluster")
    cl.add_argument("--instances", type=_positive_int("--instances"), default=8, metavar="N")
    cl.add_argument(
        "--profile",
        default="llama3-8b-h200",
        metavar="NAME",
        help="engine profile (see `tokenfleet profiles`)",
    )
    cl.add_argument(
        "--host-kv-gb",
        type=_positive_float("--host-kv-gb", True),
        default=0.0,
        metavar="N",
        help="host-memory KV tier of N GB per instance, as vLLM's offloading "
        "connector (--kv-offloading-size); 0 (default) = GPU KV only",
    )
    cl.add_argument(
        "--scrape-interval-ms",
        type=_positive_float("--scrape-interval-ms"),
        default=100.0,
        metavar="MS",
        help="engine metrics scrape interval",
    )
    kv = cl.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-events",
        dest="kv_events",
        action="store_true",
        default=None,
        help="engines publish KV events (BlockStored/BlockRemoved) to every "
        "router: dynamo_kv and tokenpilot use an exact index, llmd_weighted "
        "the precise-prefix-cache-scorer (default: each peer's shipped "
        "deployment, i.e. on for dynamo_kv and tokenpilot, off for the others)",
    )
    kv.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        help="no engine publishes KV events, not even for dynamo_kv or tokenpilot "
        "(ablation: Dynamo's --no-kv-events approximate mode)",
    )
    cl.add_argument(
        "--routers",
        type=_positive_int("--routers"),
        default=1,
        metavar="N",
        help="router replicas (each with its own accounting unless --shared-state-ms)",
    )
    cl.add_argument(
        "--shared-state-ms",
        type=_positive_float("--shared-state-ms", True),
        default=None,
        metavar="MS",
        help="router replicas share dispatch accounting, each seeing the others' "
        "changes MS late, as the live API replicas do through Redis "
        "(about 20 ms); default: independent replicas",
    )
    cl.add_argument(
        "--no-booking-check",
        dest="booking_check",
        action="store_false",
        help="with --shared-state-ms: let a decision made on the late view stand, "
        "instead of proposing again when booking it shows another replica's "
        "dispatch to that instance (what the live API does)",
    )
    pol = p.add_argument_group("policies and output")
    pol.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        help="router policy, one of: " + ", ".join(ROUTER_NAMES) + "; repeat to compare "
        "(default: " + ", ".join(DEFAULT_POLICIES) + ")",
    )
    pol.add_argument(
        "--admission",
        action="append",
        metavar="NAME",
        help="admission policy in front of the router: fcfs, strict_priority, "
        "llmd (llm-d's default legacy admission controller), "
        "llmd_flow_control (llm-d's experimental flow control, behind "
        "its flowControl feature gate), slomax; repeat to compare",
    )
    pol.add_argument(
        "--control-period-s",
        type=_positive_float("--control-period-s"),
        default=5.0,
        metavar="S",
        help="admission controller period (default 5)",
    )
    pol.add_argument(
        "--pd-prefill-share",
        type=float,
        default=None,
        metavar="F",
        help="P/D routers with a fixed split (dynamo_disagg, llmd_pd): share of "
        "instances that prefill (default 0.5; tokenpilot_pd sizes its pools itself)",
    )
    pol.add_argument("--slo", metavar="FILE", help="per-tier SLO file (YAML)")
    pol.add_argument("--seed", type=int, default=0)
    pol.add_argument("--json", metavar="OUT", help="write results as JSON")
    pol.add_argument("--plot", metavar="DIR", help="write PNG plots here")
    pol.add_argument("--quiet", action="store_true", help="no progress bar")
    fl = p.add_argument_group("multi-datacenter (FleetMind)")
    fl.add_argument(
        "--topology",
        metavar="FILE.yaml",
        help="simulate a multi-DC scenario (sites, deployments, RTTs, tenants, "
        "workload, timeline), e.g. examples/scenarios/hotspot.yaml",
    )
    fl.add_argument(
        "--fleet",
        action="append",
        metavar="NAME",
        help="DC-selection policy with --topology: none, nearest, least_loaded "
        "(naive strawman), skylb (SkyLB/SkyServe: local first, spill to the "
        "nearest exact-version region over a load threshold), fleetmind; "
        "repeat to compare (default: all)",
    )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate policies on a workload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(p)
    p.set_defaults(func=run_sim)
    ssub = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    sw = ssub.add_parser("sweep", help="run the comparison over several loads and plot it")
    add_common_args(sw)
    sw.add_argument(
        "--loads",
        default="0.4,0.6,0.8,0.9,1.0",
        metavar="F,F,...",
        help="comma-separated loads (default 0.4,0.6,0.8,0.9,1.0)",
    )
    sw.set_defaults(func=run_sweep)


# -- building blocks ------------------------------------------------------------
def _settings(args: argparse.Namespace) -> Any:
    from tokenfleet.core.tiers import SLOConfig
    from tokenfleet.engine.profiles import get_profile
    from tokenfleet.sim.runner import SimSettings

    profile = get_profile(args.profile)
    if getattr(args, "host_kv_gb", 0.0):
        profile = profile.with_overrides(host_kv_bytes=args.host_kv_gb * 1e9)
    slo = SLOConfig()
    if args.slo:
        slo = _load_slo(args.slo)
    elif getattr(args, "workload", None):
        mix = _mix(args)
        if mix.slo is not None:
            slo = SLOConfig.from_mapping(mix.slo, source=f"{mix.source}: slo")
    return SimSettings(
        profile=profile,
        instances=args.instances,
        scrape_interval_s=args.scrape_interval_ms / 1000.0,
        routers=args.routers,
        seed=args.seed,
        slo=slo,
        kv_events=args.kv_events,
        shared_state_s=(None if args.shared_state_ms is None else args.shared_state_ms / 1000.0),
        booking_check=getattr(args, "booking_check", True),
        control_period_s=getattr(args, "control_period_s", 5.0),
        pd_router_kwargs=(
            {}
            if getattr(args, "pd_prefill_share", None) is None
            else {"prefill_share": args.pd_prefill_share}
        ),
    )


def _mix(args: argparse.Namespace) -> Any:
    from tokenfleet.workloads.mix import load_mix

    cached = _MIX_CACHE.get(args.workload)
    if cached is None:
        cached = _MIX_CACHE[args.workload] = load_mix(args.workload)
    return cached


_MIX_CACHE: dict[str, Any] = {}


def _load_slo(path: str) -> Any:
    import yaml

    from tokenfleet.core.tiers import SLOConfig

    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"SLO file {path} not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return SLOConfig.from_mapping(data or {}, source=path)


def _base_requests(args: argparse.Namespace) -> list[Any]:
    from tokenfleet.workloads.loader import load_workload
    from tokenfleet.workloads.synthetic import generate

    if args.trace and args.synthetic:
        raise ConfigError("give either --trace or --synthetic, not both")
    if getattr(args, "workload", None):
        if args.trace or args.synthetic:
            raise ConfigError("give --workload alone, without --trace or --synthetic")
        from tokenfleet.workloads.mix import build_mix

        reqs = build_mix(_mix(args))
        if args.limit:
            reqs = reqs[: args.limit]
    elif args.trace:
        if not Path(args.trace).exists():
            raise ConfigError(f"trace file {args.trace} not found")
        reqs = load_workload(args.trace, args.trace_format, limit=args.limit)
    else:
        name = args.synthetic or "mixed"
        # Generated at a nominal rate; --load / --rate-scale rescale it afterwards.
        reqs = generate(name, args.limit or args.synthetic_requests, args.seed, 10.0)
    if not reqs:
        raise ConfigError("the workload has no requests")
    return list(reqs)


def _scaled(
    reqs: list[Any], args: argparse.Namespace, load: float | None, settings: Any
) -> list[Any]:
    from tokenfleet.workloads.scaling import rate_scale, scale_to_load

    if getattr(args, "workload", None):
        # A mix scales its streams only; a batch job at t=0 stays a job.
        from tokenfleet.workloads.mix import build_at_load, build_mix

        if load is not None:
            return build_at_load(_mix(args), load, settings.profile, settings.instances)[0]
        if args.rate_scale:
            return build_mix(_mix(args), args.rate_scale)
        return reqs
    if load is not None:
        return list(scale_to_load(reqs, load, settings.profile, settings.instances))
    if args.rate_scale:
        return list(rate_scale(reqs, args.rate_scale))
    return reqs


def _policies(args: argparse.Namespace) -> list[str]:
    from tokenfleet.core.routing import ROUTERS

    names = args.policy or DEFAULT_POLICIES
    if not args.policy and (getattr(args, "admission", None) or getattr(args, "workload", None)):
        # Admission comparisons hold the router fixed: the mix's, else llm-d's.
        mix_router = _mix(args).router if getattr(args, "workload", None) else None
        names = [mix_router or "llmd_weighted"]
    for n in names:
        ROUTERS.get(n)
    return names


def _progress_factory(quiet: bool) -> tuple[Any, Any]:
    if quiet or not sys.stderr.isatty() and not _force_progress():
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(
        TextColumn("{task.description:>20}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    )

    def factory(name: str, total: int) -> Callable[[int, int], None]:
        task = prog.add_task(name, total=total)

        def cb(done: int, tot: int) -> None:
            prog.update(task, completed=done)

        return cb

    return prog, factory


def _force_progress() -> bool:
    import os

    return os.environ.get("TOKENFLEET_PROGRESS") == "1"


def _table(title: str) -> Any:
    """A compact table: light rules, one space of padding, so a comparison of
    many policies fits a 100-column terminal without truncating a name."""
    from rich import box
    from rich.table import Table

    return Table(
        title=title,
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
        show_edge=False,
    )


def _header(name: str, left: bool = False) -> tuple[str, str]:
    """(header, justify): headers on two lines keep number columns narrow."""
    head = "done/\ntotal" if name == "done/total" else name.replace(" ", "\n", 1)
    return head, "left" if left else "right"


def _print(t: Any, console: Any = None) -> None:
    """Print ``t`` with no cell ever cut ("toke..."): each column is at least as
    wide as its longest cell; a terminal too narrow wraps lines instead."""
    from rich.console import Console

    for col in t.columns:
        cells = [str(c) for c in col.cells] + str(col.header).splitlines()
        col.min_width = max((len(c) for c in cells), default=0)
        col.no_wrap = True
        col.overflow = "fold"
    if console is None:
        console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(t)


def _print_table(runs: Sequence[Any], title: str, console: Any = None) -> None:

    def f(v: Any, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v * scale)

    t = _table(title)
    # a host-memory KV tier ran: show which share of the hits it served
    tiered = any(r.summary.get("host_hit_ratio") for r in runs)
    for col in (
        "policy",
        "done/total",
        "TTFT p50",
        "TTFT p95",
        "TTFT p99",
        "TPOT p50",
        "tok/s",
        "goodput tok/s",
        "SLO att.",
        "prefix hit",
        "host hit",
        "util",
        "wall s",
    ):
        if col == "host hit" and not tiered:
            continue
        t.add_column(*_header(col, left=col == "policy"))
    for r in runs:
        s = r.summary
        cells = [
            getattr(r, "label", r.policy),
            f"{s['completed']}/{s['requests']}",
            f(s["ttft_p50_s"]),
            f(s["ttft_p95_s"]),
            f(s["ttft_p99_s"]),
            f(s["tpot_p50_s"], 1000, "{:.1f}ms"),
            f(s["throughput_tok_s"], fmt="{:.0f}"),
            f(s["goodput_tok_s"], fmt="{:.0f}"),
            f(s["slo_attainment"], 100, "{:.1f}%"),
            f(s["prefix_hit_ratio"], 100, "{:.1f}%"),
        ]
        if tiered:
            cells.append(f(s.get("host_hit_ratio"), 100, "{:.1f}%"))
        cells += [f(s["utilization"], 100, "{:.0f}%"), f"{r.wall_s:.1f}"]
        t.add_row(*cells)
    _print(t, console)


def _describe(args: argparse.Namespace, load: float | None, rate_label: str = "") -> str:
    src = getattr(args, "workload", None) or args.trace or f"synthetic:{args.synthetic or 'mixed'}"
    rate = rate_label or (
        f"load {load}"
        if load
        else (f"rate x{args.rate_scale}" if args.rate_scale else "as recorded")
    )
    shared = (
        ""
        if getattr(args, "shared_state_ms", None) is None or args.routers == 1
        else f" sharing state {args.shared_state_ms:g} ms late"
        + ("" if getattr(args, "booking_check", True) else " (no booking check)")
    )
    gb = getattr(args, "host_kv_gb", 0.0)
    host = f" + {gb:g} GB host KV" if gb else ""
    kv = {None: "KV events: shipped defaults", True: "KV events: on", False: "KV events: off"}[
        getattr(args, "kv_events", None)
    ]
    return (
        f"{Path(src).name} | {args.instances} x {args.profile}{host} | {rate} | "
        f"scrape {args.scrape_interval_ms:g} ms | routers {args.routers}{shared} | {kv} | "
        f"seed {args.seed}"
    )


# -- commands -------------------------------------------------------------------
def run_sim(args: argparse.Namespace) -> int:
    from tokenfleet.sim.plots import plot_runs
    from tokenfleet.sim.runner import run_policies

    if getattr(args, "topology", None) or getattr(args, "fleet", None):
        return _run_fleet(args)
    settings = _settings(args)
    policies = _policies(args)
    load = args.load
    if load is None and not args.rate_scale and getattr(args, "workload", None):
        load = _mix(args).load  # the mix's own offered load, if it names one
    reqs = _scaled(_base_requests(args), args, load, settings)
    admissions = list(getattr(args, "admission", None) or [])
    prog, factory = _progress_factory(args.quiet)
    if prog is not None:
        with prog:
            runs = run_policies(reqs, policies, settings, progress=factory, admissions=admissions)
    else:
        runs = run_policies(reqs, policies, settings, admissions=admissions)
    title = _describe(args, load)
    _print_table(runs, title)
    if admissions:
        _print_tiers(runs)
    if args.json:
        data: dict[str, Any] = {
            "config": {**vars_for_json(args), "load": load},
            "runs": [r.as_json() for r in runs],
        }
        if getattr(args, "workload", None):
            data["workload"] = _workload_facts(args, reqs, settings)
        _write_json(args.json, data)
    if args.plot:
        paths = plot_runs(
            {getattr(r, "label", r.policy): r.records for r in runs},
            Path(args.plot),
            title,
            slo=settings.slo,
            goodput_tok_s={
                getattr(r, "label", r.policy): r.summary["goodput_tok_s"] or 0.0 for r in runs
            },
        )
        if admissions:
            from tokenfleet.sim.plots_slomax import plot_admission

            paths += plot_admission(runs, Path(args.plot), title)
        print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def _print_tiers(runs: Sequence[Any]) -> None:
    """Per-tier outcomes of admission runs (strict goodput rule)."""

    t = _table("per tier")
    for col in (
        "run",
        "tier",
        "requests",
        "SLO att.",
        "goodput tok/s",
        "rejected",
        "cancelled",
        "timed out",
        "duplicates",
        "wasted GPU-s",
    ):
        t.add_column(*_header(col, left=col in ("run", "tier")))
    for r in runs:
        for tier, m in sorted(r.summary.get("per_tier", {}).items()):
            att = m.get("slo_attainment")
            t.add_row(
                getattr(r, "label", r.policy),
                tier,
                str(m["requests"]),
                "-" if att is None else f"{100 * att:.1f}%",
                f"{m['goodput_tok_s']:.0f}",
                str(m["rejected"]),
                str(m["cancelled"]),
                str(m["timed_out"]),
                str(m["duplicates"]),
                f"{m['wasted_gpu_s']:.1f}",
            )
    _print(t)


def _workload_facts(args: argparse.Namespace, reqs: Sequence[Any], settings: Any) -> dict[str, Any]:
    from collections import Counter

    from tokenfleet.workloads.mix import offered_load

    mix = _mix(args)
    by_class = Counter(r.info.request_id.split("/", 1)[0] for r in reqs)
    return {
        "name": mix.name,
        "file": args.workload,
        "duration_s": mix.duration_s,
        "requests": len(reqs),
        "requests_per_class": dict(by_class),
        "offered_load": offered_load(reqs, settings.profile, settings.instances, mix.duration_s),
    }


def run_sweep(args: argparse.Namespace) -> int:
    from tokenfleet.sim.plots import plot_sweep
    from tokenfleet.sim.runner import run_policies

    try:
        loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--loads must be comma-separated numbers, got '{args.loads}'") from None
    if not loads or any(x <= 0 for x in loads):
        raise ConfigError("--loads must list positive loads, e.g. 0.4,0.6,0.8")
    settings = _settings(args)
    policies = _policies(args)
    base = _base_requests(args)
    results: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    out_runs = []
    admissions = list(getattr(args, "admission", None) or [])
    prog, factory = _progress_factory(args.quiet)
    for load in loads:
        reqs = _scaled(base, args, load, settings)
        if prog is not None:
            with prog:
                runs = run_policies(
                    reqs,
                    policies,
                    settings,
                    progress=lambda n, t, ld=load: factory(f"{n}@{ld}", t),
                    admissions=admissions,
                )
        else:
            runs = run_policies(reqs, policies, settings, admissions=admissions)
        _print_table(runs, _describe(args, load))
        for r in runs:
            results.setdefault(getattr(r, "label", r.policy), []).append((load, r.summary))
            d = r.as_json()
            d["load"] = load
            out_runs.append(d)
    if args.json:
        _write_json(args.json, {"config": vars_for_json(args), "runs": out_runs})
    plot_dir = Path(args.plot or ".")
    if args.plot:
        print(
            f"plot: {plot_sweep(results, plot_dir, _describe(args, None, 'loads ' + args.loads))}"
        )
    return 0


def _run_fleet(args: argparse.Namespace) -> int:
    """``--topology``: one scenario, several DC-selection policies (tokenfleet.sim.fleet)."""

    from tokenfleet.core.fleet import FLEET
    from tokenfleet.sim.fleet import load_scenario, run_fleets

    if not args.topology:
        raise ConfigError("--fleet needs --topology FILE (a multi-DC scenario)")
    for flag in ("trace", "synthetic", "workload", "policy", "admission", "load", "rate_scale"):
        if getattr(args, flag, None):
            raise ConfigError(
                f"--{flag.replace('_', '-')} does not apply with --topology: the "
                "scenario file defines the workload and each DC's router"
            )
    names = args.fleet or ["none", "nearest", "least_loaded", "skylb", "fleetmind"]
    for n in names:
        FLEET.get(n)
    sc = load_scenario(args.topology)
    prog, factory = _progress_factory(args.quiet)
    if prog is not None:
        with prog:
            runs = run_fleets(sc, names, seed=args.seed, progress=factory)
    else:
        runs = run_fleets(sc, names, seed=args.seed)
    title = (
        f"{Path(args.topology).name} | {len(sc.topology.datacenters)} sites | "
        f"{sc.duration_s:g} s | seed {args.seed}"
    )
    t = _table(title)
    for col in (
        "fleet",
        "done/total",
        "TTFT p50",
        "TTFT p95",
        "goodput tok/s",
        "SLO att.",
        "spill",
        "residency viol.",
        "version mism.",
        "plans",
        "rollbacks",
        "wall s",
    ):
        t.add_column(*_header(col, left=col == "fleet"))
    for r in runs:
        s = r.summary
        t.add_row(
            r.policy,
            f"{s['completed']}/{s['requests']}",
            "-" if s["ttft_p50_s"] is None else f"{s['ttft_p50_s']:.3f}",
            "-" if s["ttft_p95_s"] is None else f"{s['ttft_p95_s']:.3f}",
            f"{s['goodput_tok_s']:.0f}",
            "-" if s["slo_attainment"] is None else f"{100 * s['slo_attainment']:.1f}%",
            f"{100 * r.spill_fraction:.1f}%",
            str(r.residency_violations),
            str(r.version_mismatches),
            str(len(r.plans)),
            str(len(r.rollbacks)),
            f"{r.wall_s:.1f}",
        )
    _print(t)
    t = _table("per datacenter")
    for col in (
        "fleet",
        "DC",
        "requests",
        "spilled in",
        "goodput tok/s",
        "SLO att.",
        "mean load",
        "replicas at end",
    ):
        t.add_column(*_header(col, left=col in ("fleet", "DC", "replicas at end")))
    for r in runs:
        for dc, d in r.per_dc.items():
            att = d["slo_attainment"]
            t.add_row(
                r.policy,
                dc,
                str(d["requests"]),
                str(d["spilled_in"]),
                f"{d['goodput_tok_s']:.0f}",
                "-" if att is None else f"{100 * att:.1f}%",
                f"{d['load_mean']:.2f}",
                ", ".join(f"{k} x{v}" for k, v in d["replicas_end"].items()),
            )
    _print(t)
    if args.json:
        _write_json(
            args.json,
            {
                "config": vars_for_json(args),
                "scenario": {
                    "name": sc.topology.name,
                    "file": args.topology,
                    "duration_s": sc.duration_s,
                    "sites": sorted(sc.topology.datacenters),
                },
                "runs": [r.as_json() for r in runs],
            },
        )
    if args.plot:
        from tokenfleet.sim.plots_fleet import plot_fleet_runs

        paths = plot_fleet_runs(runs, Path(args.plot), title)
        print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def vars_for_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _write_json(path: str, data: dict[str, Any]) -> None:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=2, default=str))
    except OSError as exc:
        raise TokenFleetError(f"cannot write {path}: {exc.strerror}") from None
    print(f"results: {p}")
