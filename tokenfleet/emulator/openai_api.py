"""OpenAI-compatible request parsing and response shapes, as vLLM serves them.

Pure functions: the HTTP layer passes the decoded JSON body and headers in,
gets a :class:`ParsedRequest` or an :class:`ApiError` out, and builds
responses from plain values. Response fields follow vLLM's
``vllm/entrypoints/openai/protocol.py`` (chat.completion, chat.completion.chunk,
text_completion, usage with ``prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenfleet.tokenizer import (
    encode_text,
    encode_token_ids,
    num_tokens,
    render_chat,
)

#: header that forces an exact output length (the trace replayer needs it)
OUTPUT_TOKENS_HEADER = "X-Emulator-Output-Tokens"
#: median and log-spread of the default output-length draw
OUTPUT_MEDIAN_TOKENS = 128
OUTPUT_SIGMA = 1.0


class ApiError(Exception):
    """An error answered in OpenAI shape: ``{"error": {message, type, param, code}}``."""

    TYPES = {
        400: "BadRequestError",
        404: "NotFoundError",
        405: "MethodNotAllowed",
        411: "LengthRequired",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "Error"),
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(slots=True)
class ParsedRequest:
    chat: bool
    model: str | None
    prompt_stream: bytes
    input_tokens: int
    max_tokens: int  # effective budget
    output_tokens: int  # what the engine will generate
    stream: bool
    include_usage: bool
    filler_seed: int


def _int_field(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ApiError(400, f"'{name}' must be an integer >= {minimum}, got {value!r}", name)
    return value


def prompt_stream(body: Mapping[str, Any], chat: bool) -> bytes:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        try:
            return encode_text(render_chat(messages))
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return encode_text(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        try:
            return encode_token_ids(prompt)
        except ValueError as exc:
            raise ApiError(400, str(exc), "prompt") from None
    raise ApiError(
        400,
        "'prompt' must be a string or a list of token ids (one prompt per request in the emulator)",
        "prompt",
    )


def parse_request(
    body: Any,
    headers: Mapping[str, str],
    *,
    chat: bool,
    max_model_len_tokens: int,
    rng: random.Random,
) -> ParsedRequest:
    """Validate like vLLM and decide the output length (see docs/emulator.md).

    ``headers`` must have lower-case names.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model")
    n = _int_field(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, "the emulator supports only n=1", "n")
    stream_prompt = prompt_stream(body, chat)
    input_tokens = num_tokens(stream_prompt)
    if input_tokens == 0:
        raise ApiError(400, "the prompt is empty", "messages" if chat else "prompt")
    max_tokens = _int_field(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1)
    room = max_model_len_tokens - input_tokens
    if room < 1:
        raise ApiError(
            400,
            (
                f"This model's maximum context length is {max_model_len_tokens} tokens. "
                f"However, your prompt has {input_tokens} tokens. Please reduce the length "
                "of the prompt."
            ),
            "messages" if chat else "prompt",
        )
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ApiError(
            400,
            (
                f"This model's maximum context length is {max_model_len_tokens} tokens. "
                f"However, you requested {input_tokens + max_tokens} tokens ({input_tokens} "
                f"in the prompt, {max_tokens} in the completion). Please reduce the length "
                "of the prompt or completion."
            ),
            "max_tokens",
        )
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if min_tokens > max_tokens:
        raise ApiError(
            400, f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens"
        )
    forced = _forced_output_tokens(body, headers)
    # Draw even when forced, so one request's options do not shift later draws.
    median = math.log(OUTPUT_MEDIAN_TOKENS)
    drawn = max(1, int(rng.lognormvariate(median, OUTPUT_SIGMA)))
    filler_seed = rng.randrange(1 << 30)
    if forced is not None:
        output = min(forced, max_tokens)
    elif body.get("ignore_eos") is True:
        output = max_tokens
    else:
        output = min(max(drawn, min_tokens, 1), max_tokens)
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = bool(
        stream and isinstance(options, dict) and options.get("include_usage") is True
    )
    return ParsedRequest(
        chat=chat,
        model=model,
        prompt_stream=stream_prompt,
        input_tokens=input_tokens,
        max_tokens=max_tokens,
        output_tokens=output,
        stream=stream,
        include_usage=include_usage,
        filler_seed=filler_seed,
    )


def _forced_output_tokens(body: Mapping[str, Any], headers: Mapping[str, str]) -> int | None:
    raw = headers.get(OUTPUT_TOKENS_HEADER.lower())
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            raise ApiError(
                400, f"header {OUTPUT_TOKENS_HEADER} must be an integer, got {raw!r}"
            ) from None
        if value < 1:
            raise ApiError(400, f"header {OUTPUT_TOKENS_HEADER} must be >= 1")
        return value
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "output_tokens" in xargs:
        return _int_field(xargs, "output_tokens", 1)
    return None


# -- responses ----------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    chat: bool,
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    use: dict[str, Any],
) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk_body(
    chat: bool,
    rid: str,
    created: int,
    model: str,
    text: str | None,
    finish_reason: str | None,
    role: bool = False,
) -> dict[str, Any]:
    """One streamed choice delta (``text=None`` with ``role`` opens the message)."""
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(
    chat: bool, rid: str, created: int, model: str, use: dict[str, Any]
) -> dict[str, Any]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": use,
    }
