"""The FastAPI application: routes, the API key, the body cap, CORS, and OpenAI-shaped errors for everything."""
from __future__ import annotations

import asyncio
import hmac
import json
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import APIError, api_error
from .jobs import Job
from .prepare import prepare_chat, prepare_completion
from .schemas import ChatRequest, CompletionRequest
from .state import ServeState

PUBLIC_PATHS = ("/health",)
KNOWN_PATHS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


async def read_body(request: Request, model: type[BaseModel], *, max_bytes: int) -> BaseModel:
    """The body parsed and validated: 413 past max_bytes (declared or read), 400 for bad JSON or a bad value."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param,
                       code="invalid_value") from None


class Guard:
    """ASGI middleware: the API key (constant-time compare) before anything runs, and the request counter."""

    def __init__(self, app, *, key: str | None, state: ServeState) -> None:
        self.app, self.key, self.state = app, key, state
        # A browser's CORS preflight never carries credentials: with --cors it reaches the CORS middleware.
        self.public_methods = ("OPTIONS",) if state.serve.cors else ()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in KNOWN_PATHS else "other"
        status = {"code": 500}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            public = path in PUBLIC_PATHS or scope["method"] in self.public_methods
            if self.key is not None and not public and not _authorized(Request(scope), self.key):
                error = APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
                await _error_response(error)(scope, receive, counted_send)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            self.state.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()


def build_app(state: ServeState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state.worker.start()
        threading.Thread(target=state.grammars.warm_up, name="staticlm-grammar", daemon=True).start()
        yield
        state.worker.stop()

    app = FastAPI(title="staticlm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.model_id = state.model_id
    key, max_bytes = state.serve.api_key, state.serve.max_body_bytes

    if state.serve.cors:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.serve.cors), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Guard, key=key, state=state)  # outermost: the key is checked before anything else runs

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, error: APIError):
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, error: StarletteHTTPException):
        kind = "not_found" if error.status_code == 404 else None
        return _error_response(APIError(error.status_code, str(error.detail), code=kind))

    @app.exception_handler(Exception)
    async def _any_error(_request: Request, error: Exception):
        return _error_response(api_error(error))

    @app.get("/health")
    async def health():
        return {"status": "ok", **state.batcher.status()}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "staticlm", "context_length": state.max_context}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_id:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "staticlm"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(request, ChatRequest, max_bytes=max_bytes)
        try:
            job = Job(state, prepare_chat(state, body), kind="chat")
        except Exception as e:  # noqa: BLE001 -- 400/404/429 before anything ran
            raise api_error(e) from None
        if job.prep.stream:
            return _stream(job.chat_stream(_never), job)
        async with _closed_on_disconnect(request, job):
            return await job.chat_response(_never)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, CompletionRequest, max_bytes=max_bytes)
        try:
            job = Job(state, prepare_completion(state, body), kind="text")
        except Exception as e:  # noqa: BLE001 -- 400/404/429 before anything ran
            raise api_error(e) from None
        if job.prep.stream:
            return _stream(job.completion_stream(_never), job)
        async with _closed_on_disconnect(request, job):
            return await job.completion_response(_never)

    return app


@asynccontextmanager
async def _closed_on_disconnect(request: Request, job: Job):
    """While a non-streamed answer is computed: a client that goes away cancels it at once (its body is read, so
    the next ASGI message can only be the disconnect)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.close()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


async def _never() -> bool:
    return False  # a streaming response notices a disconnect itself (and closes the job, below)


def _stream(body, job: Job) -> StreamingResponse:
    # The background task runs when the stream ends, and also when the client disconnects mid-stream.
    return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(job.close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


__all__ = ["build_app", "read_body"]
