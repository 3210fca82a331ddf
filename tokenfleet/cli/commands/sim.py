"""``tokenfleet sim``: replay a workload against policies and compare them.

``tokenfleet sim sweep`` repeats the comparison over several loads and plots
TTFT against load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from tokenfleet.errors import ConfigError, TokenFleetError

DEFAULT_POLICIES = ["round_robin", "llmd_weighted", "sglang_cache_aware", "dynamo_kv"]


def _positive_float(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got '{text}'") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
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
    src.add_argument("--trace-format", choices=["mooncake", "azure", "tokenfleet"],
                     help="trace format (default: guessed from the file)")
    src.add_argument("--synthetic", metavar="NAME",
                     help="built-in synthetic workload instead of a trace (e.g. chat, mixed)")
    src.add_argument("--synthetic-requests", type=_positive_int("--synthetic-requests"),
                     default=2000, metavar="N", help="requests to generate (default 2000)")
    src.add_argument("--limit", type=_positive_int("--limit"), metavar="N",
                     help="use only the first N requests")
    rate = src.add_mutually_exclusive_group()
    rate.add_argument("--load", type=_positive_float("--load"), metavar="F",
                      help="scale arrivals so offered work = F x cluster capacity")
    rate.add_argument("--rate-scale", type=_positive_float("--rate-scale"), metavar="X",
                      help="compress time: X=2 replays twice as fast")
    cl = p.add_argument_group("cluster")
    cl.add_argument("--instances", type=_positive_int("--instances"), default=8, metavar="N")
    cl.add_argument("--profile", default="llama3-8b-h200", metavar="NAME",
                    help="engine profile (see `tokenfleet profiles`)")
    cl.add_argument("--scrape-interval-ms", type=_positive_float("--scrape-interval-ms"),
                    default=100.0, metavar="MS", help="engine metrics scrape interval")
    cl.add_argument("--routers", type=_positive_int("--routers"), default=1, metavar="N",
                    help="independent router replicas (each with its own accounting)")
    pol = p.add_argument_group("policies and output")
    pol.add_argument("--policy", action="append", metavar="NAME",
                     help="router policy; repeat to compare (default: the peer routers)")
    pol.add_argument("--slo", metavar="FILE", help="per-tier SLO file (YAML)")
    pol.add_argument("--seed", type=int, default=0)
    pol.add_argument("--json", metavar="OUT", help="write results as JSON")
    pol.add_argument("--plot", metavar="DIR", help="write PNG plots here")
    pol.add_argument("--quiet", action="store_true", help="no progress bar")


def register(sub: Any) -> None:
    p = sub.add_parser("sim", help="simulate policies on a workload",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(func=run_sim)
    ssub = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    sw = ssub.add_parser("sweep", help="run the comparison over several loads and plot it")
    add_common_args(sw)
    sw.add_argument("--loads", default="0.4,0.6,0.8,0.9,1.0", metavar="F,F,...",
                    help="comma-separated loads (default 0.4,0.6,0.8,0.9,1.0)")
    sw.set_defaults(func=run_sweep)


# -- building blocks ------------------------------------------------------------
def _settings(args: argparse.Namespace) -> Any:
    from tokenfleet.core.tiers import SLOConfig
    from tokenfleet.engine.profiles import get_profile
    from tokenfleet.sim.runner import SimSettings

    profile = get_profile(args.profile)
    slo = SLOConfig()
    if args.slo:
        slo = _load_slo(args.slo)
    return SimSettings(profile=profile, instances=args.instances,
                       scrape_interval_s=args.scrape_interval_ms / 1000.0,
                       routers=args.routers, seed=args.seed, slo=slo)


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
    if args.trace:
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


def _scaled(reqs: list[Any], args: argparse.Namespace, load: float | None,
            settings: Any) -> list[Any]:
    from tokenfleet.workloads.scaling import rate_scale, scale_to_load

    if load is not None:
        return list(scale_to_load(reqs, load, settings.profile, settings.instances))
    if args.rate_scale:
        return list(rate_scale(reqs, args.rate_scale))
    return reqs


def _policies(args: argparse.Namespace) -> list[str]:
    from tokenfleet.core.routing import ROUTERS

    names = args.policy or DEFAULT_POLICIES
    for n in names:
        ROUTERS.get(n)
    return names


def _progress_factory(quiet: bool) -> tuple[Any, Any]:
    if quiet or not sys.stderr.isatty() and not _force_progress():
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("{task.description:>20}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=False)

    def factory(name: str, total: int) -> Callable[[int, int], None]:
        task = prog.add_task(name, total=total)

        def cb(done: int, tot: int) -> None:
            prog.update(task, completed=done)

        return cb

    return prog, factory


def _force_progress() -> bool:
    import os

    return os.environ.get("TOKENFLEET_PROGRESS") == "1"


def _print_table(runs: Sequence[Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(v: Any, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        return "-" if v is None else fmt.format(v * scale)

    t = Table(title=title)
    for col in ("policy", "done/total", "TTFT p50", "TTFT p95", "TTFT p99", "TPOT p50",
                "tok/s", "goodput tok/s", "SLO att.", "prefix hit", "util", "wall s"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for r in runs:
        s = r.summary
        t.add_row(r.policy, f"{s['completed']}/{s['requests']}",
                  f(s["ttft_p50_s"]), f(s["ttft_p95_s"]), f(s["ttft_p99_s"]),
                  f(s["tpot_p50_s"], 1000, "{:.1f}ms"),
                  f(s["throughput_tok_s"], fmt="{:.0f}"), f(s["goodput_tok_s"], fmt="{:.0f}"),
                  f(s["slo_attainment"], 100, "{:.1f}%"), f(s["prefix_hit_ratio"], 100, "{:.1f}%"),
                  f(s["utilization"], 100, "{:.0f}%"), f"{r.wall_s:.1f}")
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def _describe(args: argparse.Namespace, load: float | None) -> str:
    src = args.trace or f"synthetic:{args.synthetic or 'mixed'}"
    rate = f"load {load}" if load else (f"rate x{args.rate_scale}" if args.rate_scale else "as recorded")
    return (f"{Path(src).name} | {args.instances} x {args.profile} | {rate} | "
            f"scrape {args.scrape_interval_ms:g} ms | routers {args.routers} | seed {args.seed}")


# -- commands -------------------------------------------------------------------
def run_sim(args: argparse.Namespace) -> int:
    from tokenfleet.sim.plots import plot_runs
    from tokenfleet.sim.runner import run_policies

    settings = _settings(args)
    policies = _policies(args)
    reqs = _scaled(_base_requests(args), args, args.load, settings)
    prog, factory = _progress_factory(args.quiet)
    if prog is not None:
        with prog:
            runs = run_policies(reqs, policies, settings, progress=factory)
    else:
        runs = run_policies(reqs, policies, settings)
    title = _describe(args, args.load)
    _print_table(runs, title)
    if args.json:
        _write_json(args.json, {"config": vars_for_json(args), "runs": [r.as_json() for r in runs]})
    if args.plot:
        paths = plot_runs({r.policy: r.records for r in runs}, Path(args.plot), title)
        print("plots: " + ", ".join(str(p) for p in paths))
    return 0


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
    results: dict[str, list[tuple[float, dict[str, Any]]]] = {p: [] for p in policies}
    out_runs = []
    prog, factory = _progress_factory(args.quiet)
    for load in loads:
        reqs = _scaled(base, args, load, settings)
        if prog is not None:
            with prog:
                runs = run_policies(reqs, policies, settings,
                                    progress=lambda n, t, ld=load: factory(f"{n}@{ld}", t))
        else:
            runs = run_policies(reqs, policies, settings)
        _print_table(runs, _describe(args, load))
        for r in runs:
            results[r.policy].append((load, r.summary))
            d = r.as_json()
            d["load"] = load
            out_runs.append(d)
    if args.json:
        _write_json(args.json, {"config": vars_for_json(args), "runs": out_runs})
    plot_dir = Path(args.plot or ".")
    if args.plot:
        print(f"plot: {plot_sweep(results, plot_dir, _describe(args, None))}")
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
