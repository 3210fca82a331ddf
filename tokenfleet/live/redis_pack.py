"""Redis commands packed by hiredis in one C call; the bytes on the wire are redis-py's.

redis-py (8.x) packs a command by running its encoder over every argument in
Python (a memoryview scan, then four type checks and an ``encode`` per
argument) and only then hands the tuple to ``hiredis.pack_command``, which
takes ``str``, ``bytes``, ``int`` and ``float`` itself. The live path sends
50-80 commands per request, mostly in pipelines; a dispatch's batch of 14
took 186-208 us of CPU, 137-140 us with this (``benchmarks/store_writes.py``;
docs/benchmarks.md, section 32). Here the tuple goes to hiredis as it is;
anything hiredis refuses (``bytearray``, and what redis-py refuses too:
``bool``, ``None``) takes redis-py's own packer, which converts it or raises
its ``DataError``.

Same bytes: hiredis writes ``str`` as UTF-8 and numbers as ``str(int)`` and
``repr(float)``, as redis-py's encoder does
(``tests/test_live_transport.py::test_hiredis_packing_writes_redis_pys_bytes``).
"""

from __future__ import annotations

from typing import Any

import hiredis
import redis


class HiredisPacker:
    """A connection's command packer: hiredis first, redis-py's as the fallback."""

    __slots__ = ("_fallback",)

    def __init__(self, fallback: Any) -> None:
        self._fallback = fallback

    def pack(self, *args: Any) -> list[bytes]:
        first = args[0]
        # redis-py splits a command name with spaces ("CLIENT SETNAME") into words
        if isinstance(first, str):
            args = (*first.encode().split(), *args[1:])
        elif isinstance(first, bytes) and b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            return self._fallback.pack(*args)  # type: ignore[no-any-return]


_CLASSES: dict[type[Any], type[Any]] = {}


def hiredis_connection_class(base: type[Any]) -> type[Any]:
    """``base`` (a redis-py connection class) with :class:`HiredisPacker`."""
    cls = _CLASSES.get(base)
    if cls is None:

        def _construct_command_packer(self: Any, packer: Any) -> Any:
            return HiredisPacker(base._construct_command_packer(self, packer))

        cls = type(
            f"Hiredis{base.__name__}",
            (base,),
            {"_construct_command_packer": _construct_command_packer},
        )
        _CLASSES[base] = cls
    return cls


def use_hiredis_packing(pool: redis.ConnectionPool) -> None:
    """New connections of ``pool`` pack with :class:`HiredisPacker` (before
    the pool has made any; connections a pool copies its class for, like the
    relay hub's own pool, inherit it)."""
    pool.connection_class = hiredis_connection_class(pool.connection_class)
