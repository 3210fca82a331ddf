"""``tokenfleet bench``: replay a trace against a live API; same JSON as ``tokenfleet sim``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="replay a trace against a live TokenFleet API and report goodput",
        description="Send each trace request as a streamed chat completion at its arrival "
        "time and report TTFT, TPOT, goodput and SLO attainment in the JSON shape "
        "of `tokenfleet sim --json` (policy 'live').",
    )
    p.add_argument("--url", required=True, help="API base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", required=True, metavar="FILE", help="trace file to replay")
    p.add_argument(
        "--trace-format",
        choices=["mooncake", "azure", "tokenfleet"],
        help="trace format (default: guessed from the file)",
    )
    p.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="compress time: X=2 replays twice as fast (default 1)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="replay only the first S seconds of (scaled) trace time",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N requests only")
    p.add_argument("--api-key", default=None, help="API key (default: $TOKENFLEET_API_KEY)")
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=512,
        metavar="N",
        help="most requests in flight at once (client threads)",
    )
    p.add_argument("--slo", metavar="FILE", help="per-tier SLO file (YAML) for attainment")
    p.add_argument("--json", metavar="OUT", help="write results as JSON")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def _models(url: str, key: str) -> list[str]:
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=10)
    try:
        conn.request(
            "GET",
            u.path.rstrip("/").removesuffix("/v1") + "/v1/models",
            headers={"Authorization": f"Bearer {key}"},
        )
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    if resp.status != 200:
        msg = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
        from tokenfleet.errors import ConfigError

        raise ConfigError(
            f"{url}/v1/models answered {resp.status}: {msg}; check --url and --api-key"
        )
    return [m["id"] for m in body.get("data", [])]


def run(args: argparse.Namespace) -> int:
    from tokenfleet.core.tiers import SLOConfig
    from tokenfleet.errors import ConfigError
    from tokenfleet.live.bench import replay, summary
    from tokenfleet.workloads import load_workload
    from tokenfleet.workloads.scaling import rate_scale

    key = args.api_key or os.environ.get("TOKENFLEET_API_KEY")
    if not key:
        raise ConfigError("no API key: pass --api-key or set TOKENFLEET_API_KEY")
    if args.rate_scale <= 0:
        raise ConfigError("--rate-scale must be > 0")
    slo = SLOConfig()
    if args.slo:
        import yaml

        slo = SLOConfig.from_mapping(yaml.safe_load(Path(args.slo).read_text()) or {}, args.slo)
    try:
        models = _models(args.url, key)
    except OSError as exc:
        raise ConfigError(f"cannot reach {args.url}: {exc}; is `tokenfleet up` running?") from None
    model = args.model or (models[0] if models else None)
    if model is None:
        raise ConfigError(f"{args.url} serves no model yet; wait for its engines")
    reqs = load_workload(args.trace, args.trace_format, limit=args.limit, model=model)
    if args.rate_scale != 1.0:
        reqs = rate_scale(reqs, args.rate_scale)
    if reqs and args.duration is not None:
        t0 = reqs[0].arrival_s
        reqs = [r for r in reqs if r.arrival_s - t0 < args.duration]
    if not reqs:
        raise ConfigError("no requests to replay (check --duration/--limit)")

    def progress(done: int, total: int) -> None:
        if not args.quiet and (done == total or done % max(1, total // 20) == 0):
            print(f"\rbench: {done}/{total} requests", end="", file=sys.stderr, flush=True)

    outs, wall = replay(
        args.url, key, reqs, model=model, slo=slo, max_inflight=args.max_inflight, progress=progress
    )
    if not args.quiet:
        print(file=sys.stderr)
    res = summary(outs, wall, slo)
    doc = {
        "config": {
            "url": args.url,
            "trace": args.trace,
            "rate_scale": args.rate_scale,
            "duration": args.duration,
            "limit": args.limit,
            "model": model,
            "requests": len(reqs),
        },
        "runs": [res],
    }
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2, default=str))

    def f(v: Any, scale: float = 1.0) -> str:
        return "-" if v is None else f"{v * scale:.1f}"

    print(
        f"live  requests={res['requests']} completed={res['completed']} "
        f"failed={res['failed']} rejected={res['rejected']}  "
        f"TTFT p50/p95/p99 ms={f(res['ttft_p50_s'], 1e3)}/{f(res['ttft_p95_s'], 1e3)}/"
        f"{f(res['ttft_p99_s'], 1e3)}  TPOT p50 ms={f(res['tpot_p50_s'], 1e3)}  "
        f"goodput tok/s={res['goodput_tok_s']:.1f}  attainment={f(res['slo_attainment'])}"
    )
    return 0
