"""Step stamps on the API's request path: where a request's time goes inside the process.

For measurement only (``benchmarks/live_routers.py --steps``). Hop timings
(:func:`tokenfleet.live.bench.hop_breakdown`) say how long a request spends
between processes; these say how long each step inside the API takes, from
the server handing the request to the app until its first token is written
to the client. Off unless :data:`ENV` names a directory when the process
starts: then each stamp is a call that returns at once.

A request is served by one server thread from start to first token (the
view, the dispatch and the stream's first step), so its stamps are kept in
a thread-local list and written, one JSON line per streamed request, when
its first token has been handed to the socket (:func:`flush`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the directory the API writes ``steps-<pid>.jsonl`` to (unset: no stamps)
ENV = "TOKENFLEET_STEP_LOG_DIR"

_DIR = os.environ.get(ENV, "")
ENABLED = bool(_DIR)

_local = threading.local()
_write_lock = threading.Lock()


def begin() -> None:
    """The server handed a request to the app: this thread's stamps start over."""
    _local.stamps = [("app", time.time())]


def stamp(name: str) -> None:
    """This thread's request reached step ``name`` (nothing when off, or when
    the thread is not serving a request the server began)."""
    stamps = getattr(_local, "stamps", None) if ENABLED else None
    if stamps is not None:
        stamps.append((name, time.time()))


def flush(request_id: str) -> None:
    """Write this thread's stamps as the request ``request_id``'s and stop stamping."""
    stamps = getattr(_local, "stamps", None) if ENABLED else None
    if stamps is None:
        return
    _local.stamps = None
    line = json.dumps({"id": request_id, "steps": stamps}) + "\n"
    with _write_lock, (Path(_DIR) / f"steps-{os.getpid()}.jsonl").open("a") as f:
        f.write(line)


def wrap_app(app: Callable[..., Any]) -> Callable[..., Any]:
    """``app`` as the server should call it: beginning each request's stamps when on."""

    def stamped(environ: Any, start_response: Any) -> Any:
        if ENABLED:
            begin()
        return app(environ, start_response)

    return stamped


def read_steps(directory: Path) -> dict[str, list[tuple[str, float]]]:
    """Every request's stamps written under ``directory``: {request id: [(step, wall s)]}."""
    out: dict[str, list[tuple[str, float]]] = {}
    for f in sorted(directory.glob("steps-*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            out[row["id"]] = [(str(n), float(t)) for n, t in row["steps"]]
    return out
