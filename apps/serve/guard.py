"""The ASGI middleware every request passes first: who may call (the API key; without one, only loopback Host
names, against DNS rebinding), from where (a browser Origin that --cors did not allow is refused, so a web page
cannot drive a keyless local server), what it may send (application/json), how long its body may take, and the
request counter of /metrics."""
from __future__ import annotations

import asyncio
import hmac
import ipaddress

from starlette.requests import Request

from .errors import APIError, api_error
from .state import ServeState

PUBLIC_PATHS = ("/health",)
KNOWN_PATHS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages",
               "/v1/messages/count_tokens", "/v1/responses", "/openapi.json")
LOOPBACK_NAMES = ("localhost", "localhost.")
CLIENT_ABORT = 499  # the status /metrics counts a request under when its client left before the answer


class BodyTimeout(Exception):
    """The body did not arrive within the server's body timeout (a 408)."""


def _authorized(headers, key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return True
    # Anthropic's clients send the key as x-api-key
    return hmac.compare_digest(headers.get("x-api-key", "").strip().encode(), key.encode()) and bool(key)


def host_name(host: str) -> str:
    """The name of a Host header's value, without its port ("[::1]:8080" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def is_loopback_name(name: str) -> bool:
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _json_type(content_type: str) -> bool:
    return content_type.partition(";")[0].strip().lower() == "application/json"


class Guard:
    """Outermost middleware: each check answers before anything else runs (and before the body is read)."""

    def __init__(self, app, *, state: ServeState) -> None:
        self.app, self.state, self.key = app, state, state.serve.api_key
        self.origins = frozenset(state.serve.cors)
        # A browser's CORS preflight never carries credentials: with --cors it reaches the CORS middleware.
        self.public_methods = ("OPTIONS",) if state.serve.cors else ()

    def refusal(self, scope) -> APIError | None:
        headers = Request(scope).headers
        method = scope["method"]
        host = headers.get("host")
        if self.key is None and host is not None and not is_loopback_name(host_name(host)):
            return APIError(403, f"Host {host!r} is not a loopback name; a server without --api-key answers "
                                 "only localhost, 127.0.0.1 and [::1]", code="invalid_host")
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins and origin != f"{scope.get('scheme', 'http')}://{host}":
            return APIError(403, f"Origin {origin!r} is not allowed (serve --cors ORIGIN allows one)",
                            code="origin_not_allowed")
        public = scope["path"] in PUBLIC_PATHS or method in self.public_methods
        if self.key is not None and not public and not _authorized(headers, self.key):
            return APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
        if method == "POST" and not _json_type(headers.get("content-type", "")):
            return APIError(415, "the body must be sent as Content-Type: application/json",
                            param="content-type", code="unsupported_media_type")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in KNOWN_PATHS else "other"
        status = {"code": CLIENT_ABORT}  # stays so when no answer starts: the client left first
        body = {"done": not _has_body(scope)}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = list(message.get("headers", []))
                if not body["done"] and (b"connection", b"close") not in headers:
                    # answered before the body was read (401, 404, 413...): the rest of it is never read, so the
                    # connection cannot carry another request; it closes once this answer is sent
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        try:
            error = self.refusal(scope)
            if error is not None:
                return await error.response(path=path)(scope, receive, counted_send)
            try:
                await self.app(scope, self._timed(receive, body), counted_send)
            except Exception as e:  # noqa: BLE001 -- a bug: answered (and counted) here, its traceback logged
                if status["code"] != CLIENT_ABORT:
                    raise  # the answer had started: nothing more can be said
                await api_error(e).response(path=path)(scope, receive, counted_send)
        finally:
            self.state.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
            self.state.metrics.count_error(status["code"])

    def _timed(self, receive, body: dict):
        """receive, with the whole body due within the body timeout (waits after it, for a disconnect, are not);
        body["done"] is set once it is all in."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.state.serve.body_timeout_s

        async def timed_receive():
            if body["done"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout from None
            body["done"] = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return timed_receive


def _has_body(scope) -> bool:
    """Whether the request declares a body (a Content-Length past 0, or a chunked one)."""
    headers = dict(scope.get("headers") or ())
    length = headers.get(b"content-length", b"0").strip()
    return b"transfer-encoding" in headers or not (length.isdigit() and int(length) == 0)


__all__ = ["CLIENT_ABORT", "BodyTimeout", "Guard", "host_name", "is_loopback_name"]
