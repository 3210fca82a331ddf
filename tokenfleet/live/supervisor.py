"""Child-process supervision for ``tokenfleet up`` and the live test harness.

Children run in their own session (a terminal ^C reaches only the parent,
which then stops them in order) with ``PR_SET_PDEATHSIG`` so the kernel
kills them if the parent dies without cleaning up, even by SIGKILL. A child
that dies while the supervisor runs is restarted with backoff, so a crashed
worker comes back by itself; ``stop_all`` sends SIGTERM, waits, then SIGKILLs
and reaps, leaving no process behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tokenfleet.up")

_PR_SET_PDEATHSIG = 1


def _pdeathsig(sig: int) -> Callable[[], None]:
    def preexec() -> None:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except OSError:  # pragma: no cover - not Linux
            pass

    return preexec


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    restart: bool = True
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_restart_at: float = 0.0
    started_at: float = 0.0
    stop_timeout_s: float = 10.0
    history: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, Child] = {}
        self.stopping = False

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        restart: bool = True,
        stop_timeout_s: float = 10.0,
    ) -> Child:
        child = Child(
            name=name,
            argv=list(argv),
            env=dict(env or os.environ),
            log_path=self.log_dir / f"{name}.log",
            restart=restart,
            stop_timeout_s=stop_timeout_s,
        )
        self.children[name] = child
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        with open(child.log_path, "ab") as out:
            child.proc = subprocess.Popen(
                child.argv,
                env=child.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_pdeathsig(signal.SIGKILL),
            )
        child.started_at = time.monotonic()
        log.debug("started %s pid=%s", child.name, child.pid)

    def poll(self) -> list[str]:
        """Restart children that died; returns the names restarted."""
        restarted: list[str] = []
        if self.stopping:
            return restarted
        now = time.monotonic()
        for child in self.children.values():
            if child.proc is None or child.proc.poll() is None or not child.restart:
                continue
            if child.next_restart_at == 0.0:
                child.history.append(child.proc.returncode)
                backoff = min(10.0, 0.5 * 2 ** min(child.restarts, 5))
                if now - child.started_at > 30:
                    backoff = 0.5
                child.next_restart_at = now + backoff
                log.warning(
                    "%s exited with %s; restarting in %.1fs (see %s)",
                    child.name,
                    child.proc.returncode,
                    backoff,
                    child.log_path,
                )
            if now >= child.next_restart_at:
                child.restarts += 1
                child.next_restart_at = 0.0
                self._spawn(child)
                restarted.append(child.name)
        return restarted

    def stop(self, name: str, timeout_s: float | None = None) -> None:
        child = self.children.get(name)
        if child is None or child.proc is None:
            return
        self._terminate([child], timeout_s)

    def stop_all(self, order: Sequence[str] | None = None) -> None:
        """Stop children (in ``order`` groups first, then the rest) and reap them."""
        self.stopping = True
        names = list(order or []) + [n for n in self.children if n not in (order or [])]
        for name in names:
            child = self.children.get(name)
            if child is not None:
                self._terminate([child], None)

    def _terminate(self, children: list[Child], timeout_s: float | None) -> None:
        for child in children:
            if child.alive():
                assert child.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
        for child in children:
            proc = child.proc
            if proc is None:
                continue
            wait = child.stop_timeout_s if timeout_s is None else timeout_s
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", child.name, wait)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
            # the process group may hold grandchildren (none expected): clean them too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one child (fault injection in tests)."""
        child = self.children[name]
        assert child.proc is not None
        os.kill(child.proc.pid, sig)
