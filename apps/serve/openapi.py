"""`GET /openapi.json`: the server's OpenAPI document, its request bodies the very pydantic models each endpoint
validates against (schemas.py, messages.py, responses.py), and its errors in each API's shape. The routes read
their bodies themselves (body.py: size cap, depth, parsing off the event loop), so FastAPI's own document would
show none of them; the fuzzing test (tests/test_serve_fuzz.py) generates requests from this one."""
from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from .messages import CountRequest, MessagesRequest
from .responses import ResponsesRequest
from .schemas import ChatRequest, CompletionRequest

BODIES = {"/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest,
          "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountRequest,
          "/v1/responses": ResponsesRequest}
GETS = ("/health", "/metrics", "/v1/models")
REF = "#/components/schemas/{model}"

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                          "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}


def _responses(path: str) -> dict[str, Any]:
    error = ANTHROPIC_ERROR if path.startswith("/v1/messages") else OPENAI_ERROR
    return {"200": {"description": "the answer (JSON, or an SSE stream when the request says stream)"},
            "default": {"description": "an error in the API's shape",
                        "content": {"application/json": {"schema": error}}}}


def openapi_document(*, title: str = "staticlm") -> dict[str, Any]:
    refs, defs = models_json_schema([(m, "validation") for m in BODIES.values()], ref_template=REF)
    paths: dict[str, Any] = {}
    for path, model in BODIES.items():
        paths[path] = {"post": {"operationId": path.strip("/").replace("/", "_"), "responses": _responses(path),
                                "requestBody": {"required": True, "content": {"application/json": {
                                    "schema": refs[(model, "validation")]}}}}}
    for path in GETS:
        paths[path] = {"get": {"operationId": path.strip("/").replace("/", "_"), "responses": _responses(path)}}
    paths["/v1/models/{model_id}"] = {"get": {
        "operationId": "v1_model", "responses": _responses("/v1/models"),
        "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"}, "paths": paths,
            "components": {"schemas": defs.get("$defs", {})}}


__all__ = ["BODIES", "openapi_document"]
