"""A whole live stack for integration tests and benchmarks: no mocks.

(Test support, not part of the package: ``benchmarks/live_overhead.py`` uses it
from the checkout too.)

Real Redis and (optionally) PostgreSQL from the embedded wheels, emulated
engines over real HTTP (in this process), Celery workers as real child
processes (so a test can ``kill -9`` one) and the Flask API on a real socket
in this process (so a test can look at the gateway). ``stop()`` always
cleans up everything it started; use it from a fixture finalizer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfleet.live.config import LiveConfig
from tokenfleet.live.supervisor import Supervisor

PROFILE = "llama3-8b-h200"
API_KEY = "tf-test-key"
TENANT = "test-tenant"


@dataclass
class InstanceSpec:
    dc: str
    instance_id: str
    emulator: dict[str, Any] = field(default_factory=dict)  # EmulatorServer options
    slots: int = 16
    #: extra `tokenfleet worker` arguments (e.g. --public-engine-url)
    worker_args: list[str] = field(default_factory=list)


@dataclass
class LiveStack:
    data_dir: Path
    instances: list[InstanceSpec]
    with_postgres: bool = True
    time_scale: float = 0.05
    router: str = "round_robin"
    admission: str = "none"
    live_overrides: dict[str, Any] = field(default_factory=dict)
    #: the test timings below (faster scrapes, leases, control loop) on top of
    #: LiveConfig's defaults; False runs the shipped defaults (benchmarks)
    test_timings: bool = True
    broker_url: str | None = None  # default: the embedded Redis
    with_beat: bool = False
    #: extra create_app config (e.g. {"CHAT_QUOTAS": False})
    app_config: dict[str, Any] = field(default_factory=dict)
    #: False: engines run as `tokenfleet engine-sim` processes (benchmarks: no
    #: GIL shared with the API); True: in this process, so tests can steer them
    engines_in_process: bool = True
    #: False: the API runs as a `tokenfleet api` process (benchmarks)
    api_in_process: bool = True
    engine_urls: dict[str, str] = field(default_factory=dict)
    #: True: engines already run at ``engine_urls`` (e.g. real vLLM), with their
    #: KV events at ``kv_endpoints``; the stack starts none
    external_engines: bool = False
    #: extra environment of engine processes (e.g. TOKENFLEET_EMULATOR_REQUEST_LOG;
    #: ``{instance}`` in a value becomes the instance id)
    engine_env: dict[str, str] = field(default_factory=dict)
    #: extra environment of `tokenfleet api` processes (``api_in_process=False``),
    #: e.g. ``TOKENFLEET_STEP_LOG_DIR``
    api_env: dict[str, str] = field(default_factory=dict)
    #: engine processes publish vLLM KV events (ZeroMQ) and their workers relay
    #: them (``--kv-events``), so routers get exact cache knowledge
    engine_kv_events: bool = False
    #: extra environment of the workers of one datacenter, by DC (a multi-DC test
    #: points a DC's workers at its own broker, or at a store across a WAN link)
    worker_env: dict[str, dict[str, str]] = field(default_factory=dict)
    #: engine profile of every emulated engine and worker
    profile: str = PROFILE
    #: called once the stores and engines run, before any worker starts
    before_workers: Callable[[], None] | None = None
    kv_endpoints: dict[str, str] = field(default_factory=dict)
    #: a running PostgreSQL to take a fresh database from (the test session's
    #: shared server); None: the stack starts its own under data_dir
    shared_postgres: Any = None
    _state: Any = None
    _database_name: str = ""

    redis: Any = None
    postgres: Any = None
    database_url: str | None = None
    emulators: dict[str, Any] = field(default_factory=dict)
    sup: Supervisor | None = None
    app: Any = None
    server: Any = None
    url: str = ""
    live: LiveConfig | None = None
    env: dict[str, str] = field(default_factory=dict)

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> LiveStack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from tokenfleet.emulator import EmulatorServer
        from tokenfleet.service.embedded import EmbeddedPostgres, EmbeddedRedis

        from .stores import FAST_POSTGRES_SETTINGS, fresh_database

        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o755)
        self.redis = EmbeddedRedis(self.data_dir).start()
        if self.with_postgres:
            pg = self.shared_postgres
            if pg is None:
                self.postgres = pg = EmbeddedPostgres(
                    self.data_dir, settings=FAST_POSTGRES_SETTINGS
                )
                pg.start()
            self.database_url = fresh_database(pg)
            self._database_name = self.database_url.rsplit("/", 1)[1]
        overrides: dict[str, Any] = {"router": self.router}
        if self.test_timings:
            overrides.update(
                scrape_interval_s=0.25,
                stale_after_s=1.5,
                lease_ttl_s=1.5,
                engine_stall_timeout_s=3.0,
                affinity_dead_after_s=1.0,
                engine_unhealthy_s=3.0,
                control_period_s=0.5,
                request_timeout_s=60.0,
                # a test's burst on a starved 2-core CI machine waits its turn at
                # the front gate rather than being shed (the gate has tests of its own)
                api_front_wait_s=10.0,
            )
        overrides.update(self.live_overrides)
        self.live = LiveConfig.load(env={}, **overrides)
        if self.engines_in_process and not self.external_engines:
            for spec in self.instances:
                opts = {"time_scale": self.time_scale, "seed": len(self.emulators) + 1}
                opts.update(spec.emulator)
                emu = EmulatorServer(self.profile, port=0, instance_id=spec.instance_id, **opts)
                emu.start()
                self.emulators[spec.instance_id] = emu
                self.engine_urls[spec.instance_id] = emu.url
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
        env.update(self.live.as_env())
        env.update(
            {
                "TOKENFLEET_REDIS_URL": self.redis.url,
                "TOKENFLEET_BROKER_URL": self.broker_url or self.redis.url,
                "TOKENFLEET_DATA_DIR": str(self.data_dir),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.database_url:
            env["TOKENFLEET_DATABASE_URL"] = self.database_url
        self.env = env
        self.sup = Supervisor(self.data_dir / "logs")
        if not self.engines_in_process and not self.external_engines:
            self._start_engine_processes()
        if self.before_workers is not None:
            self.before_workers()
        for spec in self.instances:
            self.start_worker(spec)
        if self.with_beat:
            self.sup.start(
                "beat",
                [sys.executable, "-m", "tokenfleet.cli.main", "beat", "--loglevel", "INFO"],
                env,
                restart=False,
            )
        if self.api_in_process:
            self._start_api()
        else:
            self._start_api_process()
        self.wait_ready()

    def _start_engine_processes(self) -> None:
        import http.client

        from tokenfleet.service.embedded import free_port

        assert self.sup is not None
        used: set[int] = set()
        for k, spec in enumerate(self.instances):
            port = free_port()
            while port in used:  # the OS may hand out a just-released port again
                port = free_port()
            used.add(port)
            ts = spec.emulator.get("time_scale", self.time_scale)
            env = dict(
                self.env,
                **{
                    k: v.replace("{instance}", spec.instance_id) for k, v in self.engine_env.items()
                },
            )
            extra: list[str] = []
            if self.engine_kv_events:
                kv_port = free_port()
                while kv_port in used:
                    kv_port = free_port()
                used.add(kv_port)
                self.kv_endpoints[spec.instance_id] = f"tcp://127.0.0.1:{kv_port}"
                extra = ["--kv-events-endpoint", self.kv_endpoints[spec.instance_id]]
            self.sup.start(
                f"engine-{spec.instance_id}",
                engine_sim_argv(port, self.profile, seed=k + 1, time_scale=ts, extra=extra),
                env,
                restart=False,
            )
            self.engine_urls[spec.instance_id] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        for url in self.engine_urls.values():
            while True:
                try:
                    conn = http.client.HTTPConnection(
                        "127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=1
                    )
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        break
                except OSError:
                    pass
                child = next(
                    c
                    for c in self.sup.children.values()
                    if c.name.startswith("engine-")
                    and url.endswith(":" + c.argv[c.argv.index("--port") + 1])
                )
                if not child.alive() or time.monotonic() > deadline:
                    tail = child.log_path.read_text(errors="replace")[-2000:]
                    raise TimeoutError(f"engine at {url} did not start:\n{tail}")
                time.sleep(0.1)

    def start_worker(self, spec: InstanceSpec) -> None:
        assert self.sup is not None
        emu = self.emulators.get(spec.instance_id)
        endpoint = getattr(emu, "kv_events_endpoint", None) or self.kv_endpoints.get(
            spec.instance_id
        )
        extra = ["--kv-events", endpoint] if endpoint else []
        self.sup.start(
            f"worker-{spec.instance_id}",
            [
                sys.executable,
                "-m",
                "tokenfleet.cli.main",
                "worker",
                "--dc",
                spec.dc,
                "--instance",
                spec.instance_id,
                "--engine-url",
                self.engine_urls[spec.instance_id],
                "--profile",
                self.profile,
                "--slots",
                str(spec.slots),
                "--loglevel",
                "INFO",
                *extra,
                *spec.worker_args,
            ],
            dict(self.env, **self.worker_env.get(spec.dc, {})),
            restart=False,
            stop_timeout_s=10.0,
        )

    def _start_api(self) -> None:
        from web import create_app
        from web.server import ApiServer

        cfg: dict[str, Any] = {
            "REDIS_URL": self.redis.url,
            "BROKER_URL": self.broker_url or self.redis.url,
            "DATA_DIR": str(self.data_dir),
            "LIVE": self.live,
            "API_KEYS": {API_KEY: TENANT},
            "ADMISSION": self.admission,
            # the batch API's runner thread is not under test here
            "BATCH_RUNNER": False,
        }
        if self.database_url:
            cfg["DATABASE_URL"] = self.database_url
        cfg.update(self.app_config)
        self.app = create_app(cfg)
        self.server = ApiServer(self.app, linger_s=self.live.api_linger_s)
        self.server.start_background()
        self.url = self.server.url

    def _start_api_process(self) -> None:
        self.url = self.start_api_process("api", wait=False)
        # a local gateway object for reading live state (never serves requests)
        from tokenfleet.live.state import LiveState

        self._state = LiveState.from_url(self.redis.url, prefix=self.live.redis_prefix)  # type: ignore[union-attr]

    def start_api_process(self, name: str, *, wait: bool = True, timeout_s: float = 60.0) -> str:
        """A `tokenfleet api` process on this stack's stores (another replica,
        as a load balancer would spread requests over); returns its URL."""
        from tokenfleet.service.embedded import free_port

        assert self.sup is not None
        port = free_port()
        seeds = ",".join(filter(None, [f"{API_KEY}={TENANT}", self.live.seed_api_keys]))  # type: ignore[union-attr]
        env = dict(self.env, **self.api_env, TOKENFLEET_SEED_API_KEYS=seeds)
        child = self.sup.start(
            name,
            [
                sys.executable,
                "-m",
                "tokenfleet.cli.main",
                "api",
                "--port",
                str(port),
                "--admission",
                self.admission,
                "--loglevel",
                "WARNING",
            ],
            env,
            restart=False,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while wait and not _answers(url):
            if not child.alive() or time.monotonic() > deadline:
                tail = child.log_path.read_text(errors="replace")[-2000:]
                raise TimeoutError(f"API replica {name} at {url} did not start:\n{tail}")
            time.sleep(0.1)
        return url

    @property
    def gateway(self) -> Any:
        if self.app is None:
            return _StateOnly(self._state, self.live)
        return self.app.extensions["tokenfleet"]

    def wait_ready(self, timeout_s: float = 60.0, n: int | None = None) -> None:
        want = len(self.instances) if n is None else n
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = time.time()
            infos = self.gateway.state.instances()
            ok = [i for i in infos if i.is_healthy(now, self.live.stale_after_s)]  # type: ignore[union-attr]
            if (
                len(ok) >= want
                and self._consuming(want)
                and (self.app is not None or self._api_answers())
            ):
                if self.app is not None:
                    # the in-process gateway's copy of the instances may be up to two
                    # refresh periods older than this read: a test's first request
                    # then saw one instance of two (a DC it did not know yet: 403
                    # instead of 200); an API in its own process has no copy here
                    self.gateway.instances(max_age_s=0.0)
                return
            self._check_workers()
            time.sleep(0.1)
        raise TimeoutError(f"live stack not ready in {timeout_s}s; logs in {self.data_dir}/logs")

    def _api_answers(self) -> bool:
        return _answers(self.url)

    def _consuming(self, want: int) -> bool:
        """Workers log 'ready' once their consumer runs."""
        assert self.sup is not None
        ready = 0
        for name, child in self.sup.children.items():
            if name.startswith("worker-") and child.alive():
                with contextlib.suppress(OSError):
                    if b" ready." in child.log_path.read_bytes():
                        ready += 1
        return ready >= want

    def _check_workers(self) -> None:
        assert self.sup is not None
        for name, child in self.sup.children.items():
            if (
                child.proc is not None
                and child.proc.poll() is not None
                and child.proc.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM)
            ):
                tail = child.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {child.proc.returncode}:\n{tail}")

    def stop(self) -> None:
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.shutdown()
        if self.app is not None:
            from web import close_app

            with contextlib.suppress(Exception):
                close_app(self.app)
        if self.sup is not None:
            self.sup.stop_all()
        for emu in self.emulators.values():
            with contextlib.suppress(Exception):
                emu.stop()
        if self.postgres is not None:
            with contextlib.suppress(Exception):
                self.postgres.stop()
        elif self.shared_postgres is not None and self._database_name:
            with contextlib.suppress(Exception):  # the session's server: keep its disk small
                self.shared_postgres.drop_database(self._database_name)
        if self.redis is not None:
            with contextlib.suppress(Exception):
                self.redis.stop()

    # -- helpers for tests --------------------------------------------------------------
    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1",
            api_key=API_KEY,
            max_retries=0,
            timeout=kwargs.pop("timeout", 30.0),
            **kwargs,
        )

    @property
    def model(self) -> str:
        if self.emulators:
            return str(next(iter(self.emulators.values())).model_name)
        return next(i.model for i in self.gateway.state.instances())

    def ledger_rows(
        self,
        where: str = "",
        timeout_s: float = 10.0,
        expect: Callable[[list[dict[str, Any]]], bool] | None = None,
    ) -> list[dict[str, Any]]:
        """Rows of the ledger (waits until ``expect(rows)`` holds, if given)."""
        import sqlalchemy as sa

        from tokenfleet.service.db import make_engine

        assert self.database_url is not None
        engine = make_engine(self.database_url)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                with engine.connect() as conn:
                    rows = [
                        dict(r)
                        for r in conn.execute(
                            sa.text(
                                "SELECT * FROM requests "
                                + (f"WHERE {where} " if where else "")
                                + "ORDER BY id"
                            )
                        ).mappings()
                    ]
                if expect is None or expect(rows) or time.monotonic() > deadline:
                    return rows
                time.sleep(0.2)
        finally:
            engine.dispose()

    def worker_log(self, instance_id: str) -> str:
        assert self.sup is not None
        return self.sup.children[f"worker-{instance_id}"].log_path.read_text(errors="replace")


def engine_sim_argv(
    port: int, profile: str, *, seed: int, time_scale: float = 1.0, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of one emulated engine (`tokenfleet engine-sim`)."""
    return [
        sys.executable,
        "-m",
        "tokenfleet.cli.main",
        "engine-sim",
        "--port",
        str(port),
        "--profile",
        profile,
        "--time-scale",
        str(time_scale),
        "--seed",
        str(seed),
        *extra,
    ]


def _answers(url: str) -> bool:
    """GET /health answers 200."""
    import http.client

    try:
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=1)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


@dataclass
class _StateOnly:
    """What tests read from ``stack.gateway`` when the API runs in another process."""

    state: Any
    live: Any


@contextlib.contextmanager
def running_stack(**kwargs: Any) -> Any:
    """A started :func:`two_dc_stack` in a fresh world-traversable temp dir
    (PostgreSQL runs as another user when we are root), stopped and removed on exit."""
    from .stores import temp_data_dir

    with temp_data_dir("tokenfleet-live-") as d:
        stack = two_dc_stack(d, **kwargs)
        stack.start()
        try:
            yield stack
        finally:
            stack.stop()


def two_dc_stack(data_dir: Path, **kwargs: Any) -> LiveStack:
    """The default test topology: dc-a and dc-b, one instance each."""
    specs = kwargs.pop("instances", None) or [
        InstanceSpec("dc-a", "a0"),
        InstanceSpec("dc-b", "b0"),
    ]
    return LiveStack(data_dir=data_dir, instances=specs, **kwargs)
