"""``tokenfleet batch``: submit and follow batch jobs over the HTTP API; run a runner.

``submit FILE --wait`` uploads a JSONL file (OpenAI batch format), creates
the batch, shows a progress bar until it ends and saves the output (and
error) file. The API is ``--base-url`` (default: ``http://<api_host>:<api_port>/v1``)
and the key ``--api-key`` / ``$TOKENFLEET_API_KEY`` / ``$OPENAI_API_KEY``.

``runner`` runs a standalone batch runner that sends lines to an
OpenAI-compatible ``--engine-url`` (API processes run their own runner
through the live path; this one is for engines outside it, and for tests).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tokenfleet.errors import ConfigError, TokenFleetError
from tokenfleet.service.config import add_config_arguments, config_from_args

TERMINAL = ("completed", "failed", "expired", "cancelled")


class _Api:
    def __init__(self, args: argparse.Namespace) -> None:
        import requests

        cfg = config_from_args(args)
        self.base = (args.base_url or f"http://{cfg.api_host}:{cfg.api_port}/v1").rstrip("/")
        key = (
            args.api_key or os.environ.get("TOKENFLEET_API_KEY") or os.environ.get("OPENAI_API_KEY")
        )
        if not key:
            raise ConfigError(
                "no API key: pass --api-key or set TOKENFLEET_API_KEY "
                "(`tokenfleet tenants keys create TENANT` makes one)"
            )
        self.s = requests.Session()
        self.s.headers["Authorization"] = f"Bearer {key}"

    def call(self, method: str, path: str, **kw: Any) -> Any:
        import requests

        try:
            resp = self.s.request(method, self.base + path, timeout=60, **kw)
        except requests.RequestException as exc:
            raise TokenFleetError(
                f"cannot reach the API at {self.base}: {exc.__class__.__name__}; "
                "is `tokenfleet up` running? (or pass --base-url)"
            ) from None
        if resp.status_code >= 400:
            try:
                msg = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = resp.text[:300]
            raise TokenFleetError(f"{method} {path}: HTTP {resp.status_code}: {msg}")
        return resp


def _describe_errors(b: dict[str, Any]) -> str:
    errs = (b.get("errors") or {}).get("data") or []
    return "; ".join(e.get("message", "") for e in errs) or "no details"


def _follow(api: _Api, b: dict[str, Any], interval_s: float) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]{task.fields[status]:<11}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        transient=False,
    ) as bar:
        counts = b["request_counts"]
        task = bar.add_task(
            "batch", total=counts["total"] or None, status=b["status"], failed=counts["failed"]
        )
        while b["status"] not in TERMINAL:
            time.sleep(interval_s)
            b = api.call("GET", f"/batches/{b['id']}").json()
            c = b["request_counts"]
            bar.update(
                task,
                total=c["total"] or None,
                completed=c["completed"] + c["failed"],
                status=b["status"],
                failed=c["failed"],
            )
    return b


def _save(api: _Api, file_id: str | None, path: Path) -> int:
    if not file_id:
        return 0
    data = api.call("GET", f"/files/{file_id}/content").content
    path.write_bytes(data)
    return data.count(b"\n")


def _cmd_submit(args: argparse.Namespace) -> int:
    src = Path(args.file)
    if not src.is_file():
        raise ConfigError(f"{src} does not exist")
    api = _Api(args)
    with open(src, "rb") as fh:
        f = api.call(
            "POST",
            "/files",
            data={"purpose": "batch"},
            files={"file": (src.name if src.suffix == ".jsonl" else src.stem + ".jsonl", fh)},
        ).json()
    meta = dict(kv.split("=", 1) for kv in args.metadata or [])
    b = api.call(
        "POST",
        "/batches",
        json={
            "input_file_id": f["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": meta or None,
        },
    ).json()
    print(f"batch {b['id']} ({b['request_counts']['total']} requests): {b['status']}")
    if b["status"] == "failed":
        raise TokenFleetError(f"batch failed validation: {_describe_errors(b)}")
    if not args.wait:
        print(f"follow it with `tokenfleet batch status {b['id']}`")
        return 0
    b = _follow(api, b, args.interval)
    c = b["request_counts"]
    print(f"batch {b['id']}: {b['status']}  completed {c['completed']}  failed {c['failed']}")
    out = Path(args.output or f"{b['id']}_output.jsonl")
    n = _save(api, b.get("output_file_id"), out)
    if n:
        print(f"output: {out} ({n} lines)")
    if b.get("error_file_id"):
        err = Path(args.errors or f"{b['id']}_errors.jsonl")
        print(f"errors: {err} ({_save(api, b['error_file_id'], err)} lines)")
    return 0 if b["status"] == "completed" else 1


def _cmd_status(args: argparse.Namespace) -> int:
    api = _Api(args)
    b = api.call("GET", f"/batches/{args.batch_id}").json()
    if args.wait:
        b = _follow(api, b, args.interval)
    print(json.dumps(b, indent=2))
    return 0


def _cmd_cancel(args: argparse.Namespace) -> int:
    api = _Api(args)
    b = api.call("POST", f"/batches/{args.batch_id}/cancel").json()
    print(f"batch {b['id']}: {b['status']}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    api = _Api(args)
    data = api.call("GET", "/batches", params={"limit": args.limit}).json()["data"]
    print(f"{'id':<40} {'status':<11} {'done':>7} {'failed':>6} {'total':>6}")
    for b in data:
        c = b["request_counts"]
        print(
            f"{b['id']:<40} {b['status']:<11} {c['completed']:>7} {c['failed']:>6} {c['total']:>6}"
        )
    return 0


def _cmd_runner(args: argparse.Namespace) -> int:
    import redis

    from tokenfleet.batch.executors import HttpExecutor
    from tokenfleet.batch.files import FileStore
    from tokenfleet.batch.runner import BatchRunner, RunnerConfig
    from tokenfleet.service.db import make_engine
    from tokenfleet.tenancy.directory import TenantDirectory
    from tokenfleet.tenancy.gate import TenancyGate
    from tokenfleet.tenancy.quota import QuotaEnforcer
    from tokenfleet.tenancy.usage import UsageRecorder

    cfg = config_from_args(args)
    db_url, redis_url = args.database_url or cfg.database_url, args.redis_url or cfg.redis_url
    if not db_url or not redis_url:
        from tokenfleet.service.endpoints import discover

        ep = discover(cfg)
        db_url, redis_url = db_url or ep.database_url, redis_url or ep.redis_url
    engine = make_engine(db_url, pool_size=4)
    client = redis.Redis.from_url(redis_url)
    usage = UsageRecorder(client, engine)
    gate = TenancyGate(TenantDirectory(engine, client), QuotaEnforcer(client), usage)
    files = FileStore(
        engine, Path(args.files_dir) if args.files_dir else cfg.resolved_data_dir() / "files"
    )
    runner = BatchRunner(
        engine,
        files,
        HttpExecutor(args.engine_url, api_key=args.engine_api_key),
        config=RunnerConfig(
            max_inflight=args.max_inflight, lease_s=args.lease_s, poll_s=args.poll_s
        ),
        gate=gate,
        name="batch-runner",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    usage.start()
    runner.start()
    print(
        f"tokenfleet batch runner: {args.max_inflight} lines at once -> {args.engine_url}",
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    runner.stop()
    usage.stop()
    engine.dispose()
    print(f"tokenfleet batch runner: stopped ({runner.stats})", file=sys.stderr, flush=True)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("batch", help="submit and follow batch jobs; run a runner")
    sub = parser.add_subparsers(dest="batch_command", metavar="ACTION", required=True)

    def api_args(p: argparse.ArgumentParser) -> None:
        add_config_arguments(p)
        p.add_argument(
            "--base-url",
            default=None,
            help="API base URL ending in /v1 (default: from api_host/api_port)",
        )
        p.add_argument(
            "--api-key",
            default=None,
            help="tenant API key (default: $TOKENFLEET_API_KEY or $OPENAI_API_KEY)",
        )
        p.add_argument("--interval", type=float, default=1.0, help="poll interval in seconds")

    p = sub.add_parser("submit", help="upload FILE (.jsonl) and create a batch")
    api_args(p)
    p.add_argument("file")
    p.add_argument("--wait", action="store_true", help="show progress until done, save output")
    p.add_argument("--output", default=None, help="where to save the output file")
    p.add_argument("--errors", default=None, help="where to save the error file")
    p.add_argument("--metadata", action="append", metavar="KEY=VALUE")
    p.set_defaults(func=_cmd_submit)

    p = sub.add_parser("status", help="show a batch (--wait: follow it)")
    api_args(p)
    p.add_argument("batch_id")
    p.add_argument("--wait", action="store_true")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("cancel", help="cancel a batch")
    api_args(p)
    p.add_argument("batch_id")
    p.set_defaults(func=_cmd_cancel)

    p = sub.add_parser("list", help="your recent batches")
    api_args(p)
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("runner", help="run a standalone batch runner against an engine URL")
    add_config_arguments(p)
    p.add_argument("--engine-url", required=True, help="OpenAI-compatible base URL (…/v1)")
    p.add_argument("--engine-api-key", default=None)
    p.add_argument("--database-url", default=None)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--files-dir", default=None, help="default: <data_dir>/files (as the API)")
    p.add_argument("--max-inflight", type=int, default=64)
    p.add_argument("--lease-s", type=float, default=30.0)
    p.add_argument("--poll-s", type=float, default=0.2)
    p.set_defaults(func=_cmd_runner)
