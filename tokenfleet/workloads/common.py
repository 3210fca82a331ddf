"""Shared pieces of the trace loaders: output budgets and field checks.

The ``max_tokens`` budget of a request whose trace does not record one is a
per-format constant (``DEFAULT_MAX_TOKENS``), never derived from the true
output length, so a policy cannot learn the truth through the budget. See
docs/workloads.md for why each value was chosen.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.core.types import RequestInfo
from tokenfleet.errors import ConfigError, TraceFormatError
from tokenfleet.workloads.trace import TraceRequest

#: Output budget used when a trace carries none. 1024 is a common chat-client
#: default; the Azure conversation service never generated more than 1000
#: tokens and Mooncake's synthetic trace at most 893, so neither is truncated.
DEFAULT_MAX_TOKENS: dict[str, int] = {
    "mooncake": 1024,
    "azure": 1024,
    "tokenfleet": 1024,
    "synthetic": 1024,
}


def engine_output_tokens(true_output_tokens: int, max_tokens: int) -> int:
    """What the engine really generates: it stops at the budget, and always
    emits at least one token (the first token may be EOS)."""
    return max(1, min(true_output_tokens, max_tokens))


def make_request(
    info: RequestInfo,
    true_output_tokens: int,
    client_timeout_s: float | None = None,
    output_block_hashes: tuple[int, ...] = (),
) -> TraceRequest:
    return TraceRequest(
        info=info,
        output_tokens=engine_output_tokens(true_output_tokens, info.max_tokens),
        client_timeout_s=client_timeout_s,
        output_block_hashes=output_block_hashes,
    )


def check_budget(max_tokens: int) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    return max_tokens


class LineChecker:
    """Field validation for one trace line, raising TraceFormatError(path, line)."""

    __slots__ = ("path", "line_no")

    def __init__(self, path: str, line_no: int) -> None:
        self.path = path
        self.line_no = line_no

    def fail(self, problem: str) -> TraceFormatError:
        return TraceFormatError(self.path, self.line_no, problem)

    def int_field(self, obj: dict[str, Any], name: str, minimum: int = 0) -> int:
        if name not in obj:
            raise self.fail(f"missing field '{name}'")
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise self.fail(f"field '{name}' must be an integer, got {v!r}")
        if v < minimum:
            raise self.fail(f"field '{name}' must be >= {minimum}, got {v}")
        return v

    def num_field(self, obj: dict[str, Any], name: str, minimum: float = 0.0) -> float:
        if name not in obj:
            raise self.fail(f"missing field '{name}'")
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(f"field '{name}' must be a number, got {v!r}")
        f = float(v)
        if not f >= minimum or f == float("inf"):
            raise self.fail(f"field '{name}' must be a finite number >= {minimum}, got {v!r}")
        return f

    def str_field(self, obj: dict[str, Any], name: str) -> str:
        v = obj[name]
        if not isinstance(v, str) or not v:
            raise self.fail(f"field '{name}' must be a non-empty string, got {v!r}")
        return v

    def int_list(self, obj: dict[str, Any], name: str) -> list[int]:
        if name not in obj:
            raise self.fail(f"missing field '{name}'")
        v = obj[name]
        if not isinstance(v, list):
            raise self.fail(f"field '{name}' must be a list of integers, got {type(v).__name__}")
        for x in v:
            if isinstance(x, bool) or not isinstance(x, int):
                raise self.fail(f"field '{name}' must hold only integers, found {x!r}")
        return v
