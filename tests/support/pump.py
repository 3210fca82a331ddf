"""A stand-in for :class:`~tokenfleet.live.engine_client.EngineCall` as the
stream pump uses it, over a socket the caller connects to a fake engine
(the pump's tests and ``benchmarks/stream_pump.py``)."""

from __future__ import annotations

import socket

from tokenfleet.live.engine_client import StreamDecoder


class FakeEngineCall:
    """What the pump uses of an engine call: its detached socket and decoder."""

    def __init__(self, engine_side: socket.socket) -> None:
        self.sock = engine_side
        self.decoder = StreamDecoder(chunked=True)
        self.aborted: str | None = None
        self.request_id = "req-1"
        self.base_url = "http://engine"

    def detach(self) -> tuple[socket.socket, bytes]:
        self.sock.setblocking(False)
        return self.sock, b""

    def reattach(self, finished: bool) -> None:
        """The stream is over: no keep-alive pool here, so the socket closes."""
        self.sock.close()

    def abort(self, reason: str) -> None:
        self.aborted = reason
        self.sock.shutdown(socket.SHUT_RDWR)
