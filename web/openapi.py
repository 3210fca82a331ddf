"""The OpenAPI 3.1 document served at ``/openapi.json``.

Written by hand (no generator dependency); a test checks every route of the
app appears here and that the request schema lists the fields we accept.
"""

from __future__ import annotations

from typing import Any

from tokenfleet import __version__

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer"}},
        },
    },
}

_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
            ]
        },
    },
}

_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "description": "A model listed by GET /v1/models."},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {"$ref": "#/components/schemas/Message"},
        },
        "max_completion_tokens": {
            "type": "integer",
            "minimum": 1,
            "description": "Output budget; default: 4096 or the context left.",
        },
        "max_tokens": {
            "type": "integer",
            "minimum": 1,
            "deprecated": True,
            "description": "Older name of max_completion_tokens.",
        },
        "stream": {"type": "boolean", "default": False},
        "stream_options": {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
            "description": "Only with stream=true: a last chunk carries usage.",
        },
        "user": {"type": "string", "description": "End-user id (session affinity)."},
        "prompt_cache_key": {
            "type": "string",
            "description": "Affinity hint: requests with the same key go to the "
            "same engine instance while it is healthy.",
        },
        "service_tier": {
            "type": "string",
            "enum": ["auto", "default", "flex"],
            "description": "'flex' runs the request in the batch tier.",
        },
        "n": {"type": "integer", "enum": [1]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "stop": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            ]
        },
        "seed": {"type": "integer"},
        "logit_bias": {
            "type": "object",
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        "safety_identifier": {"type": "string"},
        "metadata": {
            "type": "object",
            "maxProperties": 16,
            "additionalProperties": {"type": "string"},
            "description": "Accepted and ignored (no OpenAI-side storage here).",
        },
        "store": {"type": "boolean", "description": "Accepted and ignored."},
    },
    "description": "Fields not listed here get 400 (unknown_parameter); tools, "
    "response_format other than text, logprobs and the other features TokenFleet does "
    "not implement get 400 unsupported_parameter (docs/live.md).",
}

_COMPLETION = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "index": {"type": "integer"},
                    "message": {
                        "type": "object",
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": "string"},
                        },
                    },
                    "finish_reason": {"type": "string", "enum": ["stop", "length", "abort"]},
                },
            },
        },
        "usage": {"$ref": "#/components/schemas/Usage"},
    },
}


#: the legacy completions request: the chat request's fields, with ``prompt`` for ``messages``
_LEGACY_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **{
            k: v
            for k, v in _REQUEST["properties"].items()  # type: ignore[attr-defined]
            if k not in ("messages", "max_completion_tokens")
        },
        "prompt": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "oneOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"type": "integer"}},
                        ]
                    },
                },
            ],
            "description": "One prompt: text (no chat template) or token ids.",
        },
        "max_tokens": {
            "type": "integer",
            "minimum": 1,
            "default": 16,
            "description": "Output budget; default 16, as OpenAI and vLLM.",
        },
    },
}

_TEXT_COMPLETION = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "text_completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "index": {"type": "integer"},
                    "text": {"type": "string"},
                    "finish_reason": {"type": "string", "enum": ["stop", "length", "abort"]},
                },
            },
        },
        "usage": {"$ref": "#/components/schemas/Usage"},
    },
}


def _err(desc: str, retry: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": desc,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    if retry:
        out["headers"] = {
            "Retry-After": {
                "schema": {"type": "integer", "minimum": 1, "maximum": 120},
                "description": "Seconds to wait (<= 120).",
            }
        }
    return out


def document() -> dict[str, Any]:
    auth: list[dict[str, list[str]]] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "TokenFleet API",
            "version": __version__,
            "description": "OpenAI-compatible chat completions scheduled across a "
            "fleet of inference engines for goodput.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _ERROR,
                "Usage": _USAGE,
                "Message": _MESSAGE,
                "ChatCompletionRequest": _REQUEST,
                "ChatCompletion": _COMPLETION,
                "CompletionRequest": _LEGACY_REQUEST,
                "TextCompletion": _TEXT_COMPLETION,
            },
        },
        "paths": {
            "/v1/chat/completions": {
                "post": {
                    "summary": "Create a chat completion (JSON, or SSE when stream=true).",
                    "security": auth,
                    "parameters": [
                        {
                            "name": "X-TokenFleet-Tier",
                            "in": "header",
                            "required": False,
                            "schema": {
                                "type": "string",
                                "enum": ["interactive", "long_context", "batch"],
                            },
                            "description": "Force the request's tier.",
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "The completion. With stream=true: text/event-stream "
                            "of chat.completion.chunk objects, a usage chunk "
                            "if asked, then 'data: [DONE]'; an error after the "
                            "stream started is sent as an 'error' event.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/ChatCompletion"}
                                },
                                "text/event-stream": {"schema": {"type": "string"}},
                            },
                        },
                        "400": _err(
                            "Malformed or too deeply nested JSON, missing/invalid/unknown/"
                            "unsupported field, prompt too long."
                        ),
                        "401": _err("Missing, invalid or revoked API key."),
                        "403": _err("The key's tenant is disabled."),
                        "404": _err("Unknown model."),
                        "413": _err("The body is larger than max_body_bytes."),
                        "429": _err("Admission rejected the request (at capacity).", True),
                        "502": _err("All attempts failed on the engines."),
                        "503": _err("No capacity or a backing store is down.", True),
                        "504": _err("The request did not finish in time."),
                    },
                }
            },
            "/v1/completions": {
                "post": {
                    "summary": "Create a legacy text completion (JSON, or SSE when "
                    "stream=true); the same path, tiers and quotas as chat.",
                    "security": auth,
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/CompletionRequest"}
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "The completion. With stream=true: text/event-stream "
                            "of text_completion objects, a usage chunk if asked, then "
                            "'data: [DONE]'.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": "#/components/schemas/TextCompletion"}
                                },
                                "text/event-stream": {"schema": {"type": "string"}},
                            },
                        },
                        "400": _err("Malformed JSON, missing/invalid field, prompt too long."),
                        "401": _err("Missing or invalid API key."),
                        "404": _err("Unknown model."),
                        "429": _err("Admission or the tenant's quota refused it.", True),
                        "502": _err("All attempts failed on the engines."),
                        "503": _err("No capacity or a backing store is down.", True),
                        "504": _err("The request did not finish in time."),
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "summary": "Models served by live instances.",
                    "security": auth,
                    "responses": {
                        "200": {"description": "Model list."},
                        "401": _err("Missing, invalid or revoked API key."),
                    },
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One model.",
                    "security": auth,
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": {"description": "The model."},
                        "404": _err("Unknown model."),
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Liveness: Redis and healthy instances.",
                    "responses": {
                        "200": {"description": "Serving."},
                        "503": _err("Not serving.", True),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics.",
                    "responses": {"200": {"description": "Text exposition."}},
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "responses": {"200": {"description": "OpenAPI 3.1."}},
                }
            },
        },
    }
