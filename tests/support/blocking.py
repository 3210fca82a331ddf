"""A Flask app whose ``/block`` route holds its server thread until released:
for tests of what the API server does while its pool threads are taken."""

from __future__ import annotations

import threading

from flask import Flask


def blocking_app(name: str) -> tuple[Flask, threading.Event, threading.Semaphore]:
    """(app, release, inside): ``inside`` is released once per request that
    entered ``/block``; each waits for ``release`` (30 s at most). ``/health``
    answers "from the route"."""
    app = Flask(name)
    release = threading.Event()
    inside = threading.Semaphore(0)

    @app.get("/block")
    def block() -> str:
        inside.release()
        release.wait(30)
        return "done"

    @app.get("/health")
    def health() -> str:
        return "from the route"

    return app, release, inside
