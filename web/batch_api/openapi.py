"""OpenAPI 3.1 paths and schemas of the Files, Batches and usage endpoints.

Merged into the app's ``/openapi.json`` by :func:`web.batch_api.init_app`.
Schemas describe what we return (a subset of OpenAI's objects plus the
fields the official client reads), so schemathesis can check responses.
"""

from __future__ import annotations

from typing import Any

_NULLABLE_INT = {"type": ["integer", "null"]}
_NULLABLE_STR = {"type": ["string", "null"]}

FILE = {
    "type": "object",
    "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "file"},
        "bytes": {"type": "integer", "minimum": 0},
        "created_at": {"type": "integer"},
        "filename": {"type": "string"},
        "purpose": {"type": "string", "enum": ["batch", "batch_output"]},
        "status": {"type": "string"},
        "status_details": _NULLABLE_STR,
        "expires_at": _NULLABLE_INT,
    },
}

BATCH = {
    "type": "object",
    "required": [
        "id",
        "object",
        "endpoint",
        "input_file_id",
        "completion_window",
        "status",
        "created_at",
        "request_counts",
    ],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "batch"},
        "endpoint": {"type": "string"},
        "errors": {
            "type": ["object", "null"],
            "properties": {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "code": {"type": "string"},
                            "message": {"type": "string"},
                            "param": _NULLABLE_STR,
                            "line": _NULLABLE_INT,
                        },
                    },
                },
            },
        },
        "input_file_id": {"type": "string"},
        "completion_window": {"type": "string"},
        "status": {
            "type": "string",
            "enum": [
                "validating",
                "failed",
                "in_progress",
                "finalizing",
                "completed",
                "expired",
                "cancelling",
                "cancelled",
            ],
        },
        "output_file_id": _NULLABLE_STR,
        "error_file_id": _NULLABLE_STR,
        "created_at": {"type": "integer"},
        "in_progress_at": _NULLABLE_INT,
        "expires_at": _NULLABLE_INT,
        "finalizing_at": _NULLABLE_INT,
        "completed_at": _NULLABLE_INT,
        "failed_at": _NULLABLE_INT,
        "expired_at": _NULLABLE_INT,
        "cancelling_at": _NULLABLE_INT,
        "cancelled_at": _NULLABLE_INT,
        "request_counts": {
            "type": "object",
            "required": ["total", "completed", "failed"],
            "properties": {
                "total": {"type": "integer"},
                "completed": {"type": "integer"},
                "failed": {"type": "integer"},
            },
        },
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
    },
}

CREATE_BATCH = {
    "type": "object",
    "required": ["input_file_id", "endpoint", "completion_window"],
    "properties": {
        "input_file_id": {"type": "string"},
        "endpoint": {"type": "string", "enum": ["/v1/chat/completions"]},
        "completion_window": {"type": "string", "enum": ["24h"]},
        "metadata": {
            "type": ["object", "null"],
            "maxProperties": 16,
            "additionalProperties": {"type": "string", "maxLength": 512},
        },
    },
}


def _list(ref: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"$ref": ref}},
            "has_more": {"type": "boolean"},
            "first_id": _NULLABLE_STR,
            "last_id": _NULLABLE_STR,
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
                "schema": {"type": "integer", "minimum": 1},
                "description": "Seconds until the request would pass.",
            }
        }
    return out


def _ok(ref: str, desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": ref}}}}


def _id_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


_LIMIT = {
    "name": "limit",
    "in": "query",
    "required": False,
    "schema": {"type": "integer", "minimum": 1, "maximum": 100},
}
_AFTER = {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}


def fragment() -> dict[str, Any]:
    auth: list[dict[str, list[str]]] = [{"bearer": []}]
    unauth = _err("Missing, invalid or revoked API key.")
    return {
        "schemas": {
            "File": FILE,
            "Batch": BATCH,
            "CreateBatchRequest": CREATE_BATCH,
            "FileList": _list("#/components/schemas/File"),
            "BatchList": _list("#/components/schemas/Batch"),
        },
        "paths": {
            "/v1/files": {
                "post": {
                    "summary": "Upload a batch input file (.jsonl, purpose 'batch').",
                    "security": auth,
                    "requestBody": {
                        "required": True,
                        "content": {
                            "multipart/form-data": {
                                "schema": {
                                    "type": "object",
                                    "required": ["file", "purpose"],
                                    "properties": {
                                        "file": {"type": "string", "format": "binary"},
                                        "purpose": {"type": "string", "enum": ["batch"]},
                                    },
                                }
                            }
                        },
                    },
                    "responses": {
                        "200": _ok("#/components/schemas/File", "The file."),
                        "400": _err("Bad purpose, no file or not .jsonl."),
                        "401": unauth,
                        "413": _err("Larger than max_upload_bytes (200 MiB by default)."),
                    },
                },
                "get": {
                    "summary": "The caller's files, newest first.",
                    "security": auth,
                    "parameters": [
                        {
                            "name": "purpose",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string"},
                        },
                        {**_LIMIT, "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                        _AFTER,
                    ],
                    "responses": {
                        "200": _ok("#/components/schemas/FileList", "Files."),
                        "400": _err("Bad limit."),
                        "401": unauth,
                    },
                },
            },
            "/v1/files/{file_id}": {
                "get": {
                    "summary": "One file's metadata.",
                    "security": auth,
                    "parameters": [_id_param("file_id")],
                    "responses": {
                        "200": _ok("#/components/schemas/File", "The file."),
                        "401": unauth,
                        "404": _err("No such file (for you)."),
                    },
                },
                "delete": {
                    "summary": "Delete a file not used by a batch.",
                    "security": auth,
                    "parameters": [_id_param("file_id")],
                    "responses": {
                        "200": {
                            "description": "Deleted.",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "401": unauth,
                        "404": _err("No such file (for you)."),
                        "409": _err("The file belongs to a batch."),
                    },
                },
            },
            "/v1/files/{file_id}/content": {
                "get": {
                    "summary": "The file's bytes.",
                    "security": auth,
                    "parameters": [_id_param("file_id")],
                    "responses": {
                        "200": {
                            "description": "Raw content.",
                            "content": {
                                "application/octet-stream": {
                                    "schema": {"type": "string", "format": "binary"}
                                }
                            },
                        },
                        "401": unauth,
                        "404": _err("No such file (for you)."),
                        "410": _err("Content lost on disk."),
                    },
                }
            },
            "/v1/batches": {
                "post": {
                    "summary": "Create a batch from an uploaded input file. Validation "
                    "errors fail the batch; errors.data[].line names the line.",
                    "security": auth,
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/CreateBatchRequest"}
                            }
                        },
                    },
                    "responses": {
                        "200": _ok("#/components/schemas/Batch", "The batch."),
                        "400": _err("Bad endpoint, window, metadata or file."),
                        "401": unauth,
                        "404": _err("No such input file."),
                    },
                },
                "get": {
                    "summary": "The caller's batches, newest first.",
                    "security": auth,
                    "parameters": [_LIMIT, _AFTER],
                    "responses": {
                        "200": _ok("#/components/schemas/BatchList", "Batches."),
                        "400": _err("Bad limit."),
                        "401": unauth,
                    },
                },
            },
            "/v1/batches/{batch_id}": {
                "get": {
                    "summary": "One batch, with request_counts.",
                    "security": auth,
                    "parameters": [_id_param("batch_id")],
                    "responses": {
                        "200": _ok("#/components/schemas/Batch", "The batch."),
                        "401": unauth,
                        "404": _err("No such batch (for you)."),
                    },
                }
            },
            "/v1/batches/{batch_id}/cancel": {
                "post": {
                    "summary": "Cancel: pending lines end in the error file.",
                    "security": auth,
                    "parameters": [_id_param("batch_id")],
                    "responses": {
                        "200": _ok("#/components/schemas/Batch", "The batch."),
                        "400": _err("Already finished."),
                        "401": unauth,
                        "404": _err("No such batch (for you)."),
                    },
                }
            },
            "/v1/usage": {
                "get": {
                    "summary": "The caller's quotas, what is left now, and daily usage.",
                    "security": auth,
                    "responses": {
                        "200": {
                            "description": "Usage.",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "401": unauth,
                    },
                }
            },
        },
    }


CHAT_QUOTA_RESPONSES = {
    "429": _err(
        "Admission rejected the request, or a tenant quota is exhausted "
        "(error.code names the limit; Retry-After says when it would pass).",
        True,
    ),
}


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


def base_document() -> dict[str, Any]:
    """A stand-alone document for apps without web.routes' /openapi.json (tests)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "TokenFleet files/batches API", "version": "1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {},
        },
        "paths": {},
    }


def merge_into(doc: dict[str, Any]) -> dict[str, Any]:
    frag = fragment()
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("Error", _ERROR)
    schemas.update(frag["schemas"])
    doc.setdefault("paths", {}).update(frag["paths"])
    chat = doc["paths"].get("/v1/chat/completions", {}).get("post")
    if chat is not None:
        chat.setdefault("responses", {}).update(CHAT_QUOTA_RESPONSES)
    return doc
