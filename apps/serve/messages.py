"""`POST /v1/messages`, Anthropic's Messages API, over the same jobs as chat completions: a request is translated
into a chat request (system, text, tool_use and tool_result blocks become OpenAI messages), and its answer back
into content blocks (thinking, text, tool_use) or the API's event stream."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from staticlm.runtime.generate.sequence_request import Delta
from staticlm.runtime.generate.text_stream import FinishReason

from .body import validated
from .errors import bad_value
from .jobs import Job
from .schemas import ChatRequest, check_stop_lengths

MAX_STOP_SEQUENCES = 64  # the API names no cap; each one costs every token a check (schemas.MAX_STOP_CHARS)

STOP = {FinishReason.EOS: "end_turn", FinishReason.STOP_STRING: "stop_sequence", FinishReason.LENGTH: "max_tokens",
        FinishReason.CANCELLED: "end_turn"}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class Block(_Open):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None


class AnthropicMessage(_Open):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Open):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class AnthropicToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(_Open):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)  # not chat's 4 (OpenAI's cap)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    ignore_eos: bool = False  # llama-server's extra: decode to max_tokens (benchmarks)

    @field_validator("stop_sequences")
    @classmethod
    def _stop_lengths(cls, v: list[str] | None) -> list[str] | None:
        check_stop_lengths(v or [])
        return v


class CountRequest(MessagesRequest):
    max_tokens: int = 1  # count_tokens takes no max_tokens


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, part in enumerate(content):
        if part.get("type") != "text":
            raise bad_value(f"{where}[{k}]", f"{where}[{k}] is a block of type {part.get('type')!r}; this model "
                            "reads text only")
        parts.append(str(part.get("text", "")))
    return "\n".join(parts)


def _openai_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text([b.model_dump() for b in req.system], "system")
        out.append({"role": "system", "content": system})
    calls_seen: set[str] = set()
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant" and b.id and b.name:
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {})}})
                calls_seen.add(b.id)
            elif b.type == "tool_result" and m.role == "user":
                if b.tool_use_id not in calls_seen:
                    raise bad_value(f"{where}.tool_use_id", f"{where} answers tool_use id {b.tool_use_id!r}, which "
                                    "no earlier assistant turn made")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content, where)})
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier thoughts are not shown to the model again (as its templates do)
            else:
                raise bad_value(where, f"{where} is a block of type {b.type!r}, which a {m.role} turn cannot "
                                "carry here (text, tool_use, tool_result)")
        out.extend(results)
        if m.role == "assistant":
            out.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls or None})
        elif texts or not results:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def to_chat_request(req: MessagesRequest) -> ChatRequest:
    body: dict[str, Any] = {"model": req.model, "messages": _openai_messages(req), "max_tokens": req.max_tokens,
                            "stream": req.stream, "temperature": req.temperature, "top_p": req.top_p,
                            "top_k": req.top_k, "stop": req.stop_sequences or None, "ignore_eos": req.ignore_eos}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise bad_value("tool_choice.name", "tool_choice of type tool needs a name")
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
    if req.thinking is not None:
        if req.thinking.type == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        elif req.thinking.budget_tokens is None or req.thinking.budget_tokens < 1:
            raise bad_value("thinking.budget_tokens", "thinking.budget_tokens must be a number of tokens >= 1, got "
                            f"{req.thinking.budget_tokens}")
        else:
            body["reasoning_budget"] = req.thinking.budget_tokens
    return validated(ChatRequest, {k: v for k, v in body.items() if v is not None},
                     context={"max_stop_strings": None})


def chat_names(req: MessagesRequest) -> dict[str, str]:
    """The chat request's fields as the Messages API names them (errors about the translated request)."""
    tools = {f"tools[{k}].function.{a}": f"tools[{k}].{b}" for k in range(len(req.tools or ()))
             for a, b in (("parameters", "input_schema"), ("name", "name"), ("description", "description"))}
    return {**tools, "stop": "stop_sequences", "chat_template_kwargs": "thinking", "reasoning_budget": "thinking"}


def _blocks(job: Job, text: str) -> tuple[list[dict[str, Any]], bool]:
    """The answer's content blocks, and whether it called a tool."""
    thoughts, answer = job.split(text)
    content, calls = job.tool_calls(answer)
    blocks: list[dict[str, Any]] = []
    if thoughts:
        blocks.append({"type": "thinking", "thinking": thoughts, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    for c in calls:
        blocks.append({"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"),
                       "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])})
    return blocks, bool(calls)


def _message(job: Job, *, content: list, stop: str | None, output_tokens: int) -> dict[str, Any]:
    return {"id": job.id, "type": "message", "role": "assistant", "model": job.state.model_id,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": len(job.prep.prompt_ids), "output_tokens": output_tokens,
                      "cache_read_input_tokens": job.cached}}


async def message_response(job: Job) -> dict[str, Any]:
    async for _ in job.events():
        pass
    if not job.finished:
        return {}  # the client went away
    f = job.finished[0]
    blocks, called = _blocks(job, f.text)
    return _message(job, content=blocks, stop="tool_use" if called else STOP[f.reason],
                    output_tokens=len(f.token_ids))


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def message_stream(job: Job) -> AsyncIterator[str]:
    """The Messages event stream: message_start, content blocks (start, deltas, stop), message_delta, message_stop.
    Thoughts and text stream as they come; with tools, the answer is read whole at the end for its calls."""
    from .reasoning import ReasoningStream

    plan, buffered = job.prep.reasoning, job.prep.tool_names is not None
    splitter = ReasoningStream(started=plan.started) if plan and plan.split else None
    index, open_kind = -1, None

    def switch(kind: str) -> list[str]:  # close the open block, open one of kind
        nonlocal index, open_kind
        out = [_event("content_block_stop", {"index": index})] if open_kind else []
        index, open_kind = index + 1, kind
        start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
            {"type": "text", "text": ""}
        return [*out, _event("content_block_start", {"index": index, "content_block": start})]

    def emit(kind: str, text: str) -> list[str]:
        if not text:
            return []
        head = switch(kind) if open_kind != kind else []
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return [*head, _event("content_block_delta", {"index": index, "delta": delta})]

    yield _event("message_start", {"message": _message(job, content=[], stop=None, output_tokens=0)})
    try:
        async for ev in job.events():
            if isinstance(ev, Delta):
                thoughts, answer = splitter.push(ev.text) if splitter else ("", ev.text)
                for line in emit("thinking", thoughts) + ([] if buffered else emit("text", answer)):
                    yield line
                continue
            stop = STOP[ev.reason]
            if splitter:
                thoughts, answer = splitter.flush()
                for line in emit("thinking", thoughts) + ([] if buffered else emit("text", answer)):
                    yield line
            if buffered:
                blocks, called = _blocks(job, ev.text)
                for b in blocks:
                    if b["type"] == "text":
                        for line in emit("text", b["text"]):
                            yield line
                    elif b["type"] == "tool_use":
                        if open_kind:
                            yield _event("content_block_stop", {"index": index})
                        index, open_kind = index + 1, "tool_use"
                        yield _event("content_block_start", {"index": index, "content_block": {
                            "type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}})
                        yield _event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": json.dumps(b["input"])}})
                stop = "tool_use" if called else stop
            if open_kind:
                yield _event("content_block_stop", {"index": index})
            yield _event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                           "usage": {"output_tokens": len(ev.token_ids)}})
        yield _event("message_stop", {})
    except Exception as e:  # noqa: BLE001 -- headers are sent: the error goes into the stream
        yield f"event: error\ndata: {json.dumps(job.failed(e).body(anthropic=True))}\n\n"


__all__ = ["CountRequest", "MessagesRequest", "chat_names", "message_response", "message_stream", "to_chat_request"]
