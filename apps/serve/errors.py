"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the status that goes with them."""
from __future__ import annotations

import re
import sys
import traceback
from dataclasses import dataclass, replace

from staticlm.errors import UserError
from staticlm.kv_manager import ContextFull
from staticlm.runtime.generate.scheduler import QueueFull

RETRY_AFTER_S = 1
ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self, *, anthropic: bool = False) -> dict:
        if anthropic:  # the Messages API's shape: {"type": "error", "error": {"type", "message"}}
            kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
            where = f"{self.param}: " if self.param and self.param not in self.message else ""
            return {"type": "error", "error": {"type": kind, "message": where + self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, *, path: str = ""):
        """The JSON answer, in the shape of the API that path belongs to."""
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(anthropic=path.startswith(ANTHROPIC_PATHS)), status_code=self.status,
                            headers=self.headers())

    def headers(self) -> dict[str, str]:
        if self.status == 408:
            return {"Connection": "close"}  # the rest of a late body is not read: the connection cannot go on
        if self.status == 429:
            return {"Retry-After": str(RETRY_AFTER_S)}
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        return {}


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def api_error(error: BaseException) -> APIError:
    """What a client is told about an exception (a bug is a 500 without details)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, QueueFull):
        return APIError(429, f"{_first_line(error)}; retry later", type="rate_limit_error", code="queue_full")
    if isinstance(error, ContextFull):
        return APIError(400, _first_line(error), param="messages", code="context_length_exceeded")
    if isinstance(error, UserError):
        return APIError(400, _first_line(error), code="invalid_value")
    # A bug: the client gets a bare 500, the server's stderr keeps the traceback.
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    return APIError(500, f"internal error: {type(error).__name__}", type="server_error", code="internal_error")


def bad_value(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def renamed(error: APIError, names: dict[str, str]) -> APIError:
    """An error about a translated request (a chat request built from a Responses or Messages body) with its
    `param` named as the client's API names it: {"messages": "input"} turns "messages[2].content" into
    "input[2].content" (in the message too)."""
    param = error.param
    for old, new in names.items():
        if param is not None and re.match(re.escape(old) + r"($|[.\[])", param):
            new_param = new + param[len(old):]
            return replace(error, param=new_param, message=error.message.replace(param, new_param))
    return error


__all__ = ["APIError", "api_error", "bad_value", "renamed"]
