"""Validate one chat completion request: body -> :class:`ChatRequest`.

The body is the parsed JSON of ``POST /v1/chat/completions``; the prompt is
tokenized here, once (:func:`tokenfleet.tokenizer.tokenize_chat`), and every
later step (quota, admission, routing, the prefix index) reads the counts and
block hashes from the result. Errors are :class:`InvalidRequest` and friends
with the OpenAI wording.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tokenfleet.core.tiers import SLOConfig, classify
from tokenfleet.core.types import RequestInfo
from tokenfleet.live.gateway.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
)
from tokenfleet.tokenizer import BYTE_TOKENIZER, ChatPrompt, PromptTokenizer

TIER_HEADER = "X-TokenFleet-Tier"
#: default output budget when the client gives none (vLLM uses all the context left)
DEFAULT_MAX_TOKENS = 4096
#: body fields passed through to the engine unchanged (validated below)
PASSTHROUGH = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "vllm_xargs",
    "top_k",
    "repetition_penalty",
)
#: OpenAI fields TokenFleet reads itself (model, messages, limits, streaming, routing hints)
HANDLED = (
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
)
#: OpenAI fields accepted and ignored: they change nothing about the answer here
#: (``metadata`` and ``store: false`` only label OpenAI-side storage, which
#: TokenFleet does not have; its ledger records every request anyway)
IGNORED = ("metadata", "store")
#: OpenAI fields whose feature TokenFleet does not implement: a request that uses
#: them gets a 400 ``unsupported_parameter`` rather than an answer without it. The
#: value says what the field may hold and still be accepted (its "off" value).
UNSUPPORTED: dict[str, str] = {
    "tools": "null or []",
    "tool_choice": 'null or "none"',
    "parallel_tool_calls": "null",
    "functions": "null or []",
    "function_call": 'null or "none"',
    "response_format": '{"type": "text"}',
    "logprobs": "false",
    "top_logprobs": "null",
    "audio": "null",
    "modalities": '["text"]',
    "prediction": "null",
    "reasoning_effort": "null",
    "verbosity": "null",
    "web_search_options": "null",
}
SERVICE_TIERS = ("auto", "default", "flex")
#: every field a chat completion body may carry
KNOWN_FIELDS = (
    frozenset(HANDLED) | frozenset(PASSTHROUGH) | frozenset(IGNORED) | frozenset(UNSUPPORTED)
)
#: every field a legacy ``/v1/completions`` body may carry: the chat fields that
#: make sense without messages, plus ``prompt`` and the legacy-only features
COMPLETION_FIELDS = (KNOWN_FIELDS - {"messages", "max_completion_tokens"}) | {
    "prompt",
    "echo",
    "suffix",
    "best_of",
}
#: legacy-only features TokenFleet does not implement, with their "off" value
COMPLETION_UNSUPPORTED: dict[str, str] = {
    "echo": "false",
    "suffix": "null",
    "best_of": "1",
    "logprobs": "null",
}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 4
MAX_METADATA_PAIRS = 16


@dataclass(slots=True)
class ChatRequest:
    """A validated request, ready to dispatch."""

    info: RequestInfo
    body: dict[str, Any]  # what the engine gets
    stream: bool
    include_usage: bool
    model: str
    created: int
    deadline_s: float | None = None
    #: the tenant quota budget it is charged to: "batch" when the client asked
    #: for the batch tier (header) or flex service, else "interactive"
    budget: str = "interactive"
    #: True when the client set no max_tokens: ``info.max_tokens`` is then our
    #: default, and the quota may reserve less of it (web.quota)
    max_tokens_implicit: bool = False


def validate_chat(
    body: Any,
    *,
    tenant: str,
    models: Mapping[str, int],
    slo: SLOConfig,
    tier_hint: str = "",
    slo_class: str | None = None,
    tokenizer: PromptTokenizer = BYTE_TOKENIZER,
    kind: str = "chat",
) -> ChatRequest:
    """Check ``body`` against the served ``models`` ({name: context length});
    ``tokenizer`` is the served model's (default: the emulator's byte tokenizer).

    ``kind="completion"``: a legacy ``/v1/completions`` body (``prompt``, see
    :func:`completion_prompt`) instead of ``messages``; everything after the
    prompt (budget, tier, quota, routing) is the chat path's.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        raise InvalidRequest("you must provide a model parameter", param="model")
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model")
    if kind == "completion":
        messages: Any = []
        completion = completion_prompt(body.get("prompt"), tokenizer)
    else:
        messages = body.get("messages")
        completion = None
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest(
                "'messages' must be a non-empty array of messages", param="messages"
            )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(
                f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]"
            )
        if m["role"] not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role '{m['role']}' is not one of system, "
                "developer, user, assistant, tool",
                param=f"messages[{i}].role",
            )
    max_tokens = _opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    n = _opt_int(body, "n")
    if n is not None and n != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    include_usage = bool(stream and options and options.get("include_usage") is True)
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body.get(name), str):
            raise InvalidRequest(f"'{name}' must be a string", param=name)
    check_fields(body, kind)
    if model not in models:
        if not models:
            raise NoCapacity("no engine instance is up yet; retry shortly")
        raise ModelNotFound(
            f"The model `{model}` does not exist or you do not have "
            f"access to it. Available: {', '.join(sorted(models))}",
            param="model",
        )
    try:
        prompt = tokenizer.tokenize_chat(messages) if completion is None else completion
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="messages") from None
    input_tokens = prompt.input_tokens
    max_len = models[model]
    if input_tokens + 1 > max_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens. However, your "
            f"messages resulted in {input_tokens} tokens. Please reduce the length of the "
            "messages.",
            param="messages",
        )
    room = max_len - input_tokens
    implicit = max_tokens is None
    if max_tokens is None:
        max_tokens = min(room, DEFAULT_MAX_TOKENS)
    elif max_tokens > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {input_tokens + max_tokens} tokens ({input_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            param="max_tokens",
        )
    if tier_hint and tier_hint not in slo.tiers:
        raise InvalidRequest(
            f"header {TIER_HEADER} must be one of {', '.join(sorted(slo.tiers))}", param=TIER_HEADER
        )
    task_type = "batch" if body.get("service_tier") == "flex" else "chat"
    now = time.time()
    info = RequestInfo(
        request_id=uuid.uuid4().hex,
        arrival_s=now,
        input_tokens=input_tokens,
        max_tokens=max_tokens,
        block_hashes=prompt.block_hashes,
        tenant=tenant,
        task_type=task_type,
        tier=tier_hint,
        model=model,
        session=body.get("user"),
        prompt_cache_key=body.get("prompt_cache_key"),
        slo_class=slo_class,
    )
    tier = classify(info, slo)
    deadline = None
    tslo = slo.slo_for(tier)
    if tier == "batch" and tslo.deadline_s is not None:
        deadline = now + tslo.deadline_s
    info = replace(info, tier=tier, deadline_s=deadline)
    engine_body: dict[str, Any] = {
        "model": model,
        **({"messages": messages} if completion is None else {"prompt": body["prompt"]}),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for k in PASSTHROUGH:
        if k in body:
            engine_body[k] = body[k]
    budget = "batch" if tier_hint == "batch" or task_type == "batch" else "interactive"
    return ChatRequest(
        info=info,
        body=engine_body,
        stream=stream,
        include_usage=include_usage,
        model=model,
        created=int(now),
        deadline_s=deadline,
        budget=budget,
        max_tokens_implicit=implicit,
    )


def completion_prompt(prompt: Any, tokenizer: PromptTokenizer = BYTE_TOKENIZER) -> ChatPrompt:
    """A ``/v1/completions`` prompt, tokenized once: a string, a list of token ids,
    or a list of exactly one of those (``n`` prompts per request are not supported)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        return tokenizer.tokenize_text(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        try:
            return tokenizer.tokenize_ids(prompt)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="prompt") from None
    raise InvalidRequest(
        "'prompt' must be a non-empty string or array of token ids (one prompt per request)",
        param="prompt",
    )


def _opt_int(body: Mapping[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {v!r}", param=name)
    if v <= 0:
        raise InvalidRequest(
            f"'{name}' must be at least 1, got {v}", param=name, code="invalid_value"
        )
    return v


def check_fields(body: Mapping[str, Any], kind: str = "chat") -> None:
    """Refuse unknown fields, unimplemented features and out-of-range sampling values.

    Why so strict: a field the server silently drops changes the answer
    without telling the client (``temperature: "hot"``, ``tools`` that are
    never called); OpenAI itself answers 400 for each of these.
    """
    known = COMPLETION_FIELDS if kind == "completion" else KNOWN_FIELDS
    unsupported = dict(UNSUPPORTED)
    if kind == "completion":
        unsupported.update(COMPLETION_UNSUPPORTED)
    for name in body:
        if name not in known:
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {name}. Remove it; see "
                "docs/live.md (request fields) for the fields TokenFleet accepts.",
                param=str(name),
                code="unknown_parameter",
            )
    for name, allowed in unsupported.items():
        if name in body and not _is_off(name, body[name]):
            raise InvalidRequest(
                f"'{name}' is not supported by TokenFleet; remove it or set it to {allowed}.",
                param=name,
                code="unsupported_parameter",
            )
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _number(body, "repetition_penalty", 0.0, None, low_open=True)
    _integer(body, "seed", None)
    _integer(body, "top_k", -1)
    _integer(body, "min_tokens", 0)
    for name in ("ignore_eos", "store"):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise InvalidRequest(f"'{name}' must be a boolean, got {v!r}", param=name)
    for name in ("vllm_xargs",):
        v = body.get(name)
        if v is not None and not isinstance(v, dict):
            raise InvalidRequest(f"'{name}' must be an object", param=name)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if (
            not isinstance(stop, list)
            or len(stop) > MAX_STOP_SEQUENCES
            or not all(isinstance(x, str) for x in stop)
        ):
            raise InvalidRequest(
                f"'stop' must be a string or an array of at most {MAX_STOP_SEQUENCES} strings",
                param="stop",
            )
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(
            isinstance(k, str) and k.isdigit() and _is_number(v) and -100 <= v <= 100
            for k, v in bias.items()
        ):
            raise InvalidRequest(
                "'logit_bias' must map token ids (strings of digits) to numbers in [-100, 100]",
                param="logit_bias",
            )
    meta = body.get("metadata")
    if meta is not None and (
        not isinstance(meta, dict)
        or len(meta) > MAX_METADATA_PAIRS
        or not all(isinstance(v, str) for v in meta.values())
    ):
        raise InvalidRequest(
            f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} string values",
            param="metadata",
        )
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise InvalidRequest(
            f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}",
            param="service_tier",
            code="invalid_value",
        )


def _is_off(name: str, v: Any) -> bool:
    """Whether an unsupported field holds its "feature off" value."""
    if v is None:
        return True
    if name in ("tools", "functions"):
        return bool(v == [])
    if name in ("tool_choice", "function_call"):
        return bool(v == "none")
    if name == "response_format":
        return isinstance(v, dict) and v.get("type") == "text" and len(v) == 1
    if name == "logprobs":
        return v is False
    if name == "echo":
        return v is False
    if name == "best_of":
        return bool(v == 1)
    if name == "modalities":
        return bool(v == ["text"])
    return False


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _number(
    body: Mapping[str, Any], name: str, low: float, high: float | None, *, low_open: bool = False
) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_number(v):
        raise InvalidRequest(f"'{name}' must be a number, got {v!r}", param=name)
    if (v <= low if low_open else v < low) or (high is not None and v > high):
        span = f"above {low:g}" if high is None else f"between {low:g} and {high:g}"
        raise InvalidRequest(
            f"'{name}' must be {span}, got {v!r}", param=name, code="invalid_value"
        )


def _integer(body: Mapping[str, Any], name: str, low: int | None) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {v!r}", param=name)
    if low is not None and v < low:
        raise InvalidRequest(
            f"'{name}' must be at least {low}, got {v}", param=name, code="invalid_value"
        )
