"""Validation of a batch input file (OpenAI Batch API JSONL), line by line.

Each line is ``{"custom_id": str, "method": "POST", "url": <endpoint>,
"body": {...}}``. The first problem fails the whole batch with an error that
names its 1-based line number, in OpenAI's ``errors.data[]`` shape
(``code``, ``message``, ``param``, ``line``), like the OpenAI API does for
a bad input file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from tokenfleet.errors import TokenFleetError

#: OpenAI's per-batch limit
MAX_LINES = 50_000
#: endpoints a batch may target (what the live path serves)
SUPPORTED_ENDPOINTS = ("/v1/chat/completions",)
MAX_CUSTOM_ID_CHARS = 200


class BatchInputError(TokenFleetError):
    """The input file is invalid; ``line`` is 1-based (None: the file as a whole)."""

    def __init__(
        self, code: str, message: str, *, line: int | None = None, param: str | None = None
    ) -> None:
        where = f"line {line}: " if line is not None else ""
        super().__init__(where + message)
        self.code = code
        self.line = line
        self.param = param
        self.detail = message

    def as_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": str(self), "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class InputLine:
    line_no: int
    custom_id: str
    body: dict[str, Any]


def iter_input_lines(
    fh: IO[bytes],
    endpoint: str,
    *,
    allowed_models: tuple[str, ...] = (),
    max_lines: int = MAX_LINES,
) -> Iterator[InputLine]:
    """Yield validated lines; raise :class:`BatchInputError` at the first bad one.

    Blank lines are skipped (but still counted for line numbers, so the
    number matches what an editor shows).
    """
    seen: set[str] = set()
    count = 0
    for line_no, raw in enumerate(fh, start=1):
        if not raw.strip():
            continue
        count += 1
        if count > max_lines:
            raise BatchInputError(
                "too_many_lines",
                f"the file has more than {max_lines} requests; split it "
                f"into several batches of at most {max_lines} lines",
                line=line_no,
            )
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BatchInputError("invalid_json", f"not valid JSON ({exc})", line=line_no) from None
        if not isinstance(obj, dict):
            raise BatchInputError(
                "invalid_request", "each line must be a JSON object", line=line_no
            )
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise BatchInputError(
                "missing_custom_id",
                "'custom_id' must be a non-empty string",
                line=line_no,
                param="custom_id",
            )
        if len(cid) > MAX_CUSTOM_ID_CHARS:
            raise BatchInputError(
                "invalid_custom_id",
                f"'custom_id' is longer than {MAX_CUSTOM_ID_CHARS} characters",
                line=line_no,
                param="custom_id",
            )
        if cid in seen:
            raise BatchInputError(
                "duplicate_custom_id",
                f"custom_id '{cid}' appears more than once; custom_ids must "
                "be unique within a batch",
                line=line_no,
                param="custom_id",
            )
        seen.add(cid)
        method = obj.get("method", "POST")
        if method != "POST":
            raise BatchInputError(
                "invalid_method",
                f"method must be POST, got {method!r}",
                line=line_no,
                param="method",
            )
        url = obj.get("url")
        if url != endpoint:
            raise BatchInputError(
                "mismatched_endpoint",
                f"url {url!r} does not match the batch endpoint '{endpoint}'",
                line=line_no,
                param="url",
            )
        body = obj.get("body")
        if not isinstance(body, dict):
            raise BatchInputError(
                "invalid_body", "'body' must be a JSON object", line=line_no, param="body"
            )
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BatchInputError(
                "missing_model",
                "body.model must be a non-empty string",
                line=line_no,
                param="body.model",
            )
        if allowed_models and model not in allowed_models:
            raise BatchInputError(
                "model_not_allowed",
                f"model '{model}' is not available to this tenant (allowed: "
                f"{', '.join(allowed_models)})",
                line=line_no,
                param="body.model",
            )
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BatchInputError(
                "invalid_body",
                "body.messages must be a non-empty array",
                line=line_no,
                param="body.messages",
            )
        if body.get("stream"):
            raise BatchInputError(
                "invalid_body",
                "streaming is not supported in batches",
                line=line_no,
                param="body.stream",
            )
        yield InputLine(line_no, cid, body)
    if count == 0:
        raise BatchInputError("empty_file", "the input file has no requests")
