"""One thread that notices every waiting client's hang-up, for the emulator.

Each handler thread of the emulator used to wake every 50 ms to ask its own
socket whether the client had gone: with 1,000 streams open that was 20,000
wake-ups a second per emulator, most of its CPU while it held many slow
streams (docs/benchmarks.md, "Overload"), and the starved emulator then
answered its scrapes too late to be judged healthy. vLLM notices a hang-up
from its event loop (``http.disconnect``) without polling; here one thread
waits in ``epoll`` for ``EPOLLRDHUP`` (the peer closed its end) on every
socket whose request is in the engine, and calls that request's ``on_gone``.
Handler threads then sleep until a token, an end or a hang-up wakes them.

``EPOLLIN`` is not watched: a keep-alive client may send its next request
while a stream is open, and those bytes are not a hang-up.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("tokenfleet.emulator")

_GONE = (
    getattr(select, "EPOLLRDHUP", 0x2000)
    | getattr(select, "EPOLLHUP", 0x10)
    | getattr(select, "EPOLLERR", 0x8)
)


class HangupWatch:
    """``watch(sock, on_gone)`` until ``unwatch(sock)``; ``on_gone`` runs on the
    watch thread, at most once, when the peer closes its end."""

    available = hasattr(select, "epoll")

    def __init__(self) -> None:
        self._ep = select.epoll() if self.available else None
        self._lock = threading.Lock()
        self._calls: dict[int, Callable[[], None]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, sock: socket.socket, on_gone: Callable[[], None]) -> bool:
        """Start watching; False (nothing watched) when epoll is missing or the
        socket is closed, so the caller falls back to asking the socket itself."""
        if self._ep is None or self._closed:
            return False
        try:
            fd = sock.fileno()
        except OSError:
            return False
        with self._lock:
            try:
                self._ep.register(fd, _GONE)
            except OSError:
                return False
            self._calls[fd] = on_gone
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hangups", daemon=True)
                self._thread.start()
        return True

    def unwatch(self, sock: socket.socket) -> None:
        """Stop watching (before the socket is closed: its number can be reused)."""
        if self._ep is None:
            return
        try:
            fd = sock.fileno()
        except OSError:
            return
        with self._lock:
            if self._calls.pop(fd, None) is not None:
                try:
                    self._ep.unregister(fd)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        if self._ep is not None:
            with self._lock:
                self._calls.clear()
            self._ep.close()

    def _run(self) -> None:
        ep = self._ep
        assert ep is not None
        while not self._closed:
            try:
                ready = ep.poll(1.0)
            except (OSError, ValueError):  # closed under us
                return
            for fd, _ev in ready:
                with self._lock:
                    call = self._calls.pop(fd, None)
                    if call is not None:
                        try:
                            ep.unregister(fd)
                        except OSError:
                            pass
                if call is not None:
                    try:
                        call()
                    except Exception:  # a handler's callback must not stop the watch
                        log.exception("hang-up callback failed")
