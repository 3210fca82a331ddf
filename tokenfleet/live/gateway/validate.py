"""Validate one chat completion request: body -> :class:`ChatRequest`.

The body is the parsed JSON of ``POST /v1/chat/completions``; the prompt is
tokenized here, once (:func:`tokenfleet.tokenizer.tokenize_chat`), and every
later step (quota, admission, routing, the prefix index) reads the counts and
block hashes from the result. Errors are :class:`InvalidRequest` and friends
with the OpenAI wording.
"""

from __future__ import annotations

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
from tokenfleet.tokenizer import ChatPrompt, tokenize_chat, tokenize_prompt, tokenize_token_ids

TIER_HEADER = "X-TokenFleet-Tier"
#: default output budget when the client gives none (vLLM uses all the context left)
DEFAULT_MAX_TOKENS = 4096
#: body fields passed through to the engine unchanged
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
ROLES = ("system", "developer", "user", "assistant", "tool")


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


def validate_chat(
    body: Any,
    *,
    tenant: str,
    models: Mapping[str, int],
    slo: SLOConfig,
    tier_hint: str = "",
    slo_class: str | None = None,
    kind: str = "chat",
) -> ChatRequest:
    """Check ``body`` against the served ``models`` ({name: context length}).

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
        completion = completion_prompt(body.get("prompt"))
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
    for name in ("user", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body.get(name), str):
            raise InvalidRequest(f"'{name}' must be a string", param=name)
    if model not in models:
        if not models:
            raise NoCapacity("no engine instance is up yet; retry shortly")
        raise ModelNotFound(
            f"The model `{model}` does not exist or you do not have "
            f"access to it. Available: {', '.join(sorted(models))}",
            param="model",
        )
    try:
        prompt = tokenize_chat(messages) if completion is None else completion
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
    )


def completion_prompt(prompt: Any) -> ChatPrompt:
    """A ``/v1/completions`` prompt, tokenized once: a string, a list of token ids,
    or a list of exactly one of those (``n`` prompts per request are not supported)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        return tokenize_prompt(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        try:
            return tokenize_token_ids(prompt)
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
