"""A request body read and parsed: the size cap while it arrives, then JSON and the pydantic model off the event
loop (a large body would otherwise hold every other request, /health and the running streams)."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from .errors import APIError

# Deeper JSON than any request needs (a JSON schema of 20 levels is already unusual); past it: 400. The stdlib
# parser itself gives up near 1,000 levels with a RecursionError, which would otherwise be a 500.
MAX_JSON_DEPTH = 64


class ClientGone(Exception):
    """The client closed the connection before its body was complete (a client abort, not an error of ours)."""

    def __init__(self, num_bytes: int) -> None:
        super().__init__(f"client left after {num_bytes} bytes of its body")
        self.num_bytes = num_bytes


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {max_bytes} bytes (serve --max-body-bytes raises it)",
                    code="request_too_large")


async def read_bytes(request: Request, *, max_bytes: int) -> bytes:
    """The raw body: 413 as soon as the declared or received size passes max_bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(size) from None
    return b"".join(chunks)


def _depth_ok(data: Any) -> bool:
    """No list or object nested deeper than MAX_JSON_DEPTH (iterative: deep input must not recurse here)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        if depth > MAX_JSON_DEPTH:
            return False
        stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return True


def parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """JSON, then the model: 400 for bad JSON, nesting past MAX_JSON_DEPTH, or a bad value (naming its field)."""
    too_deep = APIError(400, f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise too_deep from None
    if not _depth_ok(data):
        raise too_deep
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                       code="invalid_value") from None


async def read_body(request: Request, model: type[BaseModel], *, max_bytes: int) -> BaseModel:
    """The body parsed and validated, the parsing on a worker thread."""
    raw = await read_bytes(request, max_bytes=max_bytes)
    return await run_in_threadpool(parse, raw, model)


__all__ = ["MAX_JSON_DEPTH", "ClientGone", "parse", "read_body", "read_bytes"]
