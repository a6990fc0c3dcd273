"""One request's life on the server: submitted to the engine, its events read back (metrics observed on the
way), and turned into an OpenAI response or its SSE stream. A client that goes away cancels its request."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from staticlm.runtime.generate.sequence_request import Admitted, Delta, Failed, Finished, SequenceRequest, TokenLogprob

from .errors import APIError, api_error
from .formats import (
    FINISH,
    chat_chunk,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    sse,
    usage,
    usage_chunk,
)
from .prepare import Prepared
from .reasoning import ReasoningStream, split_reasoning
from .state import ServeState
from .tool_calls import parse_tool_calls
from .worker import EventQueue

CANCEL_POLL_S = 0.5  # how often a request waiting for its first event checks it was cancelled
ID_PREFIX = {"chat": "chatcmpl-", "text": "cmpl-", "message": "msg_", "response": "resp_"}


class Job:
    """Submitting raises QueueFull (429) or a UserError (400) before any response starts."""

    def __init__(self, state: ServeState, prep: Prepared, *, kind: str) -> None:
        self.state, self.prep = state, prep
        self.id = ID_PREFIX[kind] + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._queue = EventQueue()
        self.request = SequenceRequest(prompt_ids=prep.prompt_ids, params=prep.params, on_event=self._queue.put,
                                       num_choices=prep.num_choices, num_logprobs=prep.num_logprobs,
                                       constraint=prep.constraint)
        self.t0 = time.perf_counter()
        state.worker.submit(self.request)
        n = prep.num_choices
        self.cached = 0
        self.finished: dict[int, Finished] = {}
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self._last: list[float | None] = [None] * n
        self._first_seen = False

    async def events(self) -> AsyncIterator[Delta | Finished]:
        """The request's answer events until every choice finished, or the request is cancelled: a client that left
        closes its job (a stream through Starlette, which cancels it on the disconnect and then runs its background
        task; a whole answer through app.py's _closed_on_disconnect), and the poll below sees that."""
        try:
            while len(self.finished) < self.prep.num_choices:
                event = await self._queue.get(timeout=CANCEL_POLL_S)
                if event is None:
                    if self.request.cancelled:
                        return  # (a request cancelled while it waited for a row gets no more events)
                    continue
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Admitted):
                    self._admitted(event)
                    continue
                self._observe(event)
                yield event
        finally:
            self.close()

    def failed(self, error: BaseException) -> APIError:
        """What a stream says of an error after its headers went out (a 200 already counted): counted here."""
        err = api_error(error)
        self.state.metrics.count_error(err.status)
        return err

    def close(self) -> None:
        """The client is gone (or the response is complete): an unfinished request frees its rows."""
        if len(self.finished) < self.prep.num_choices and not self.request.cancelled:
            self.request.cancel()
            self.state.worker.wake()

    def _admitted(self, event: Admitted) -> None:
        m = self.state.metrics
        self.cached = event.num_cached_tokens
        m.prompt_tokens.inc(event.num_prompt_tokens)
        m.cached_tokens.inc(event.num_cached_tokens)
        if event.num_cached_tokens:
            m.cache_hits.inc()

    def _observe(self, event: Delta | Finished) -> None:
        m = self.state.metrics
        if isinstance(event, Finished):
            self.finished[event.choice] = event
            m.completion_tokens.inc(len(event.token_ids))
            return
        if not self._first_seen:
            self._first_seen = True
            m.ttft.observe(event.time - self.t0)
        last, n = self._last[event.choice], len(event.token_ids)
        if last is not None and n:
            for _ in range(n):
                m.token_latency.observe((event.time - last) / n)
        self._last[event.choice] = event.time
        self.logprobs[event.choice].extend(event.logprobs)

    def usage(self) -> dict[str, Any]:
        done = sum(len(f.token_ids) for f in self.finished.values())
        return usage(prompt=len(self.prep.prompt_ids), completion=done, cached=self.cached)

    def split(self, text: str) -> tuple[str | None, str]:
        """(the thoughts, or None; the answer) of a whole answer."""
        plan = self.prep.reasoning
        if plan is None or not plan.split:
            return None, text
        return split_reasoning(text, started=plan.started)

    def tool_calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if self.prep.tool_names is None:
            return text, []
        return parse_tool_calls(text, tool_names=self.prep.tool_names)

    # -- chat ---------------------------------------------------------------------------------------
    async def chat_response(self) -> dict[str, Any]:
        async for _ in self.events():
            pass
        if len(self.finished) < self.prep.num_choices:
            return {}  # the client went away: nobody reads this
        tok, choices = self.state.model.tokenizer, []
        for i in range(self.prep.num_choices):
            f = self.finished[i]
            thoughts, answer = self.split(f.text)
            content, calls = self.tool_calls(answer)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thoughts is not None:
                message["reasoning_content"] = thoughts
            if calls:
                message["tool_calls"] = calls
            lp = chat_logprobs(tok, self.logprobs[i]) if self.prep.num_logprobs is not None else None
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": "tool_calls" if calls else FINISH[f.reason]})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.state.model_id,
                "system_fingerprint": None, "choices": choices, "usage": self.usage()}

    async def chat_stream(self) -> AsyncIterator[str]:
        head = {"rid": self.id, "created": self.created, "model": self.state.model_id}
        tok, want_lp, buffered = self.state.model.tokenizer, self.prep.num_logprobs is not None, self.prep.tool_names
        plan, n = self.prep.reasoning, self.prep.num_choices
        splitters = [ReasoningStream(started=plan.started) for _ in range(n)] if plan and plan.split else None

        def chunk(index: int, delta: dict[str, Any], **kw) -> str:
            return sse(chat_chunk(**head, index=index, delta=delta, **kw))

        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for ev in self.events():
                if isinstance(ev, Delta):
                    thoughts, answer = splitters[ev.choice].push(ev.text) if splitters else ("", ev.text)
                    lp = chat_logprobs(tok, list(ev.logprobs)) if want_lp and ev.logprobs else None
                    if thoughts:
                        yield chunk(ev.choice, {"reasoning_content": thoughts}, logprobs=lp)
                        lp = None
                    if buffered is None and (answer or lp):
                        yield chunk(ev.choice, {"content": answer}, logprobs=lp)
                    continue
                finish = FINISH[ev.reason]
                if splitters:
                    thoughts, answer = splitters[ev.choice].flush()
                    if thoughts:
                        yield chunk(ev.choice, {"reasoning_content": thoughts})
                    if answer and buffered is None:
                        yield chunk(ev.choice, {"content": answer})
                if buffered is not None:
                    content, calls = self.tool_calls(self.split(ev.text)[1])
                    if calls:
                        yield chunk(ev.choice, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                        finish = "tool_calls"
                    elif content:
                        yield chunk(ev.choice, {"content": content})
                yield chunk(ev.choice, {}, finish=finish)
            if self.prep.include_usage:
                yield sse(usage_chunk(**head, obj="chat.completion.chunk", usage_=self.usage()))
        except Exception as e:  # noqa: BLE001 -- headers are sent: the error goes into the stream
            yield sse(self.failed(e).body())
        yield sse("[DONE]")

    # -- completions --------------------------------------------------------------------------------
    def _completion_lp(self, items: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if self.prep.num_logprobs is None:
            return None
        return completion_logprobs(self.state.model.tokenizer, items, offset=offset)

    async def completion_response(self) -> dict[str, Any]:
        async for _ in self.events():
            pass
        if len(self.finished) < self.prep.num_choices:
            return {}  # the client went away: nobody reads this
        echo = self.prep.prompt_text
        choices = [{"index": i, "text": echo + self.finished[i].text,
                    "logprobs": self._completion_lp(self.logprobs[i], len(echo)),
                    "finish_reason": FINISH[self.finished[i].reason]} for i in range(self.prep.num_choices)]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.state.model_id,
                "choices": choices, "usage": self.usage()}

    async def completion_stream(self) -> AsyncIterator[str]:
        head = {"rid": self.id, "created": self.created, "model": self.state.model_id}
        offsets = [0] * self.prep.num_choices
        try:
            async for ev in self.events():
                if isinstance(ev, Delta):
                    lp = self._completion_lp(list(ev.logprobs), offsets[ev.choice])
                    offsets[ev.choice] += len(ev.text)
                    yield sse(completion_chunk(**head, index=ev.choice, text=ev.text, logprobs=lp))
                else:
                    yield sse(completion_chunk(**head, index=ev.choice, text="", finish=FINISH[ev.reason]))
            if self.prep.include_usage:
                yield sse(usage_chunk(**head, obj="text_completion", usage_=self.usage()))
        except Exception as e:  # noqa: BLE001 -- headers are sent: the error goes into the stream
            yield sse(self.failed(e).body())
        yield sse("[DONE]")


__all__ = ["Job"]
