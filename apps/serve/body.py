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


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_tree(data: Any) -> None:
    """No list or object nested deeper than MAX_JSON_DEPTH, and no string (value or key) with a lone surrogate
    ("\\ud800" is valid JSON, but no UTF-8 text: the tokenizer would raise on it). Iterative: deep input must not
    recurse here."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, str):
            if _has_surrogate(node):
                param = param_name(where)
                raise APIError(400, f"{param or 'the body'}: a string holds a lone UTF-16 surrogate, which is not "
                               "text", param=param, code="invalid_value")
            continue
        if isinstance(node, dict):
            children = []
            for key, child in node.items():
                if _has_surrogate(key):
                    raise APIError(400, "a key holds a lone UTF-16 surrogate, which is not text",
                                   param=param_name(where), code="invalid_value")
                children.append((key, child))
        elif isinstance(node, list):
            children = list(enumerate(node))
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        stack.extend((child, depth + 1, (*where, key)) for key, child in children
                     if isinstance(child, (dict, list, str)))


def param_name(loc: tuple | list) -> str | None:
    """A field's path as OpenAI's `param` writes it: ("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or None


def _in_data(data: Any, loc: tuple, *, missing: bool) -> tuple:
    """pydantic's error location without the union members' tags it inserts ("str", "list[ContentPart]", a model's
    name): the keys and indexes that are in the data (and a missing field's name, last)."""
    out, node = [], data
    for k, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (missing and k == len(loc) - 1):
            continue
        out.append(part)
    return tuple(out)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """JSON, then the model: 400 for bad JSON (NaN and Infinity too, and integers past Python's 4,300 digits),
    nesting past MAX_JSON_DEPTH, a lone surrogate, or a bad value (naming its field)."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer too long to convert, NaN
        raise APIError(400, f"the body is not valid JSON: {_first_line(e)}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    _check_tree(data)
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return validated(model, data)


def validated(model: type[BaseModel], data: dict, *, context: dict | None = None) -> BaseModel:
    """data as the model, or a 400 naming the first bad field OpenAI's way (messages[0].content)."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        raise invalid(e, data) from None


def invalid(error: ValidationError, data: Any) -> APIError:
    """The 400 for a body the model refused: of its errors, the one deepest in the data (a union's members each
    report one: {"type": "function"} as tool_choice is missing its name, not a bad string)."""
    found = [(_in_data(data, tuple(e["loc"]), missing=e["type"] == "missing"), e["msg"]) for e in error.errors()]
    loc, message = max(found, key=lambda item: len(item[0]))  # the first among the deepest
    param = param_name(loc)
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


async def read_body(request: Request, model: type[BaseModel], *, max_bytes: int) -> BaseModel:
    """The body parsed and validated, the parsing on a worker thread."""
    raw = await read_bytes(request, max_bytes=max_bytes)
    return await run_in_threadpool(parse, raw, model)


__all__ = ["MAX_JSON_DEPTH", "ClientGone", "invalid", "param_name", "parse", "read_body", "read_bytes", "validated"]
