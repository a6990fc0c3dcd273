"""The FastAPI application: routes, CORS, and OpenAI-shaped errors for everything (the checks every request
passes first are guard.py's, the body's reading body.py's)."""
from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .body import ClientGone, read_body
from .errors import APIError, api_error, renamed
from .guard import CLIENT_ABORT, BodyTimeout, Guard
from .jobs import Job
from .messages import CountRequest, MessagesRequest, chat_names, message_response, message_stream, to_chat_request
from .openapi import openapi_document
from .prepare import prepare_chat, prepare_completion
from .responses import ResponsesRequest, prepare_response, response_answer, response_stream
from .schemas import ChatRequest, CompletionRequest
from .state import ServeState


def client_left(state: ServeState, request: Request, what: str) -> Response:
    """A client abort: counted, one line on stderr, and an answer nobody reads (its status is what /metrics
    counts)."""
    state.metrics.client_aborts.inc()
    client = request.client
    who = f"{client.host}:{client.port}" if client else "a client"
    print(f"staticlm serve: {who} left {what} ({request.method} {request.url.path})", file=sys.stderr, flush=True)
    return Response(status_code=CLIENT_ABORT)


async def prepared(state: ServeState, prepare, body):
    """prepare(state, body) on a worker thread: templates and tokenizing a long prompt take a while."""
    try:
        return await run_in_threadpool(prepare, state, body)
    except Exception as e:  # noqa: BLE001 -- 400/404/429 before anything ran
        raise api_error(e) from None


async def answered(state: ServeState, request: Request, job: Job, *, stream: bool,
                   streamed: Callable[[], AsyncIterator[str]], whole: Callable[[], Awaitable[dict]]):
    """A job's answer: its event stream (streamed()), or the whole answer (whole(); empty when the job ended
    unfinished: its client left), which a client that leaves first cancels."""
    if stream:
        return _stream(streamed(), job)
    async with _closed_on_disconnect(request, job):
        answer = await whole()
    return answer or client_left(state, request, "before its answer was complete")


def build_app(state: ServeState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        # The grammars' llguidance tokenizer is built by the first request that needs one (about a second): held
        # from the start, a 150,000-token vocabulary's costs the server ~120 MB that most never use.
        state.worker.start()
        yield
        state.worker.stop()

    app = FastAPI(title="staticlm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.model_id = state.model_id
    max_bytes = state.max_body_bytes

    if state.serve.cors:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.serve.cors), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])
    app.add_middleware(Guard, state=state)  # outermost: its checks run before anything else

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error.response(path=request.url.path)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, error: ClientGone):
        return client_left(state, request, f"after {error.num_bytes} bytes of its body")

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, _error: BodyTimeout):
        return APIError(408, f"the request body did not arrive within {state.serve.body_timeout_s:g} s",
                        code="request_timeout").response(path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return APIError(error.status_code, str(error.detail), code=kind).response(path=request.url.path)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, error: Exception):
        return api_error(error).response(path=request.url.path)

    @app.get("/health")
    async def health():
        return {"status": "ok", **state.generation_loop.status()}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    document = openapi_document(title=f"staticlm serve: {state.model_id}")

    @app.get("/openapi.json")
    async def openapi():
        return document

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
        job = submitted(state, await prepared(state, prepare_chat, body), kind="chat")
        return await answered(state, request, job, stream=job.prep.stream, streamed=job.chat_stream,
                              whole=job.chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request, CompletionRequest, max_bytes=max_bytes)
        job = submitted(state, await prepared(state, prepare_completion, body), kind="text")
        return await answered(state, request, job, stream=job.prep.stream, streamed=job.completion_stream,
                              whole=job.completion_response)

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await read_body(request, MessagesRequest, max_bytes=max_bytes)
        job = submitted(state, await prepared(state, _prepare_message, body), kind="message")
        return await answered(state, request, job, stream=body.stream, streamed=lambda: message_stream(job),
                              whole=lambda: message_response(job))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await read_body(request, CountRequest, max_bytes=max_bytes)
        prep = await prepared(state, _prepare_message, body)
        return {"input_tokens": len(prep.prompt_ids)}

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await read_body(request, ResponsesRequest, max_bytes=max_bytes)
        prep, conversation = await prepared(state, prepare_response, body)
        job = submitted(state, prep, kind="response")
        return await answered(state, request, job, stream=body.stream,
                              streamed=lambda: response_stream(job, body, conversation),
                              whole=lambda: response_answer(job, body, conversation))

    return app


def _prepare_message(state: ServeState, body: MessagesRequest):
    try:
        return prepare_chat(state, to_chat_request(body))
    except APIError as e:
        raise renamed(e, chat_names(body)) from None


def submitted(state: ServeState, prep, *, kind: str) -> Job:
    try:
        return Job(state, prep, kind=kind)
    except Exception as e:  # noqa: BLE001 -- 400/429 before anything ran
        raise api_error(e) from None


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


def _stream(body, job: Job) -> StreamingResponse:
    # The background task runs when the stream ends, and also when the client disconnects mid-stream.
    return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(job.close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


__all__ = ["build_app", "read_body"]
