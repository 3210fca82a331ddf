"""Input limits of the API: body size and JSON nesting depth.

Why: a 300 MB chat body used to be read whole into memory (the API grew by
~290 MB) before its 400, and a 10,000-deep JSON array overflowed the
parser's recursion (500). Every body is now capped before it is read:
``Content-Length`` above the limit gets 413 at once, and a body without one
(chunked) is cut off with 413 as soon as it passes the limit (werkzeug's
``max_content_length`` wraps the input stream), so at most the limit is ever
buffered. Limits come from :class:`~tokenfleet.live.config.LiveConfig`
(``max_body_bytes``, ``max_upload_bytes``, ``max_json_depth``), read from
``app.extensions["tokenfleet.limits"]`` per request so they can be changed on
a running app.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from flask import Flask, current_app, request
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.wsgi import LimitedStream

from tokenfleet.live.config import LiveConfig
from web.errors import ApiError

_CAP_KEY = "tokenfleet.body_cap"
#: multipart framing (boundaries, part headers, the purpose field) on top of the file
MULTIPART_OVERHEAD_BYTES = 1024 * 1024


@dataclass(slots=True)
class Limits:
    max_body_bytes: int
    max_upload_bytes: int
    max_json_depth: int

    @classmethod
    def from_live(cls, live: LiveConfig) -> Limits:
        return cls(live.max_body_bytes, live.max_upload_bytes, live.max_json_depth)


def limits() -> Limits:
    """This app's limits (LiveConfig defaults when the app was built without them)."""
    lim = current_app.extensions.get("tokenfleet.limits")
    if lim is None:
        lim = Limits.from_live(LiveConfig())
        current_app.extensions["tokenfleet.limits"] = lim
    return lim


def install(app: Flask, live: LiveConfig) -> None:
    """Cap every request body of ``app`` at ``max_body_bytes`` (uploads raise their own cap)."""
    app.extensions["tokenfleet.limits"] = Limits.from_live(live)
    app.before_request(_cap_body)


#: endpoints that take a file upload: capped at ``max_upload_bytes`` (plus framing)
UPLOAD_ENDPOINTS = frozenset({"batch_api.create_file"})


def _cap_body() -> None:
    lim = limits()
    if request.endpoint in UPLOAD_ENDPOINTS:
        cap_body(lim.max_upload_bytes + MULTIPART_OVERHEAD_BYTES, "file")
    else:
        cap_body(lim.max_body_bytes)


def cap_body(max_bytes: int, what: str = "request body") -> None:
    """Refuse this request's body if it is larger than ``max_bytes`` (413).

    With a ``Content-Length`` the check is immediate, before a byte is read.
    Without one (chunked), reading stops one byte past ``max_bytes``
    (werkzeug's ``max_content_length`` stops quietly at its limit, so it is set
    one byte higher) and :func:`body_over_cap` tells the reader.
    """
    request.environ[_CAP_KEY] = max_bytes
    request.max_content_length = max_bytes + 1
    size = request.content_length
    if size is not None and size > max_bytes:
        raise too_large(max_bytes, what, size)


def body_cap() -> int:
    """The cap :func:`cap_body` set for this request (else the app's JSON body limit)."""
    cap = request.environ.get(_CAP_KEY)
    return int(cap) if cap is not None else limits().max_body_bytes


def body_over_cap() -> bool:
    """Whether what was read of a body without Content-Length went past its cap."""
    stream = request.stream
    return isinstance(stream, LimitedStream) and stream.tell() > body_cap()


def too_large(max_bytes: int, what: str = "request body", size: int | None = None) -> ApiError:
    got = f" ({size:,} bytes)" if size is not None else ""
    fix = (
        "split the file into several batches"
        if what == "file"
        else "send less (shorter messages), or split the work into several requests"
    )
    return ApiError(
        413,
        f"The {what}{got} is larger than this server accepts ({max_bytes:,} bytes); {fix}. "
        "The limit is set by the operator (TOKENFLEET_MAX_BODY_BYTES / "
        "TOKENFLEET_MAX_UPLOAD_BYTES).",
        code="request_too_large",
        param="file" if what == "file" else None,
    )


def read_json(*, empty_ok: bool = False) -> Any:
    """The request's JSON body, within the size and depth limits; raises a 400/413 ApiError."""
    lim = limits()
    if _CAP_KEY not in request.environ:  # an app without install(): cap it here
        cap_body(lim.max_body_bytes)
    cap = body_cap()
    try:
        raw = _read_body(cap)
    except RequestEntityTooLarge:
        raise too_large(cap) from None
    if len(raw) > cap:
        raise too_large(cap)
    if not raw:
        if empty_ok:
            return None
        raise ApiError(
            400,
            "We could not parse the JSON body of your request: the body is "
            "empty. Send a JSON object.",
            code="invalid_json",
        )
    try:
        body = json.loads(raw)
    except RecursionError:
        raise too_deep(lim.max_json_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(
            400,
            f"We could not parse the JSON body of your request ({exc}). Send valid JSON.",
            code="invalid_json",
        ) from None
    if json_depth_exceeds(body, lim.max_json_depth):
        raise too_deep(lim.max_json_depth)
    return body


def _read_body(cap: int) -> bytes | bytearray:
    """The body, or its first ``cap + 1`` bytes when it has no Content-Length.

    Read into one growing buffer: ``get_data`` on a stream without a length
    builds a buffer and then copies it, twice the memory at the peak."""
    if request.content_length is not None:
        return request.get_data(cache=False)
    stream = request.stream
    buf = bytearray()
    while len(buf) <= cap:
        chunk = stream.read(min(64 * 1024, cap + 1 - len(buf)))
        if not chunk:
            break
        buf += chunk
    return buf


def too_deep(max_depth: int) -> ApiError:
    return ApiError(
        400,
        f"The JSON body is nested deeper than {max_depth} levels of arrays and objects; "
        "flatten it (chat messages need fewer than 10).",
        code="invalid_json",
    )


def json_depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether ``value`` nests arrays/objects deeper than ``max_depth``.

    Iterative, so a deep document cannot overflow the stack here either;
    scalars are skipped without being pushed."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False
