"""`POST /v1/responses`, OpenAI's Responses API, over the same jobs as chat completions: input items (messages,
function calls and their outputs) and `instructions` become chat messages, after the stored conversation of
`previous_response_id`; the answer becomes output items (reasoning, message, function_call) or the API's event
stream. Conversations are kept in a bounded store, least recently used out first."""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from staticlm.runtime.generate.sequence_request import Delta
from staticlm.runtime.generate.text_stream import FinishReason

from .body import validated
from .errors import APIError, bad_value, renamed
from .jobs import Job
from .schemas import ChatRequest

# A chat request's fields as the Responses API names them (errors about the translated request name these)
CHAT_TO_RESPONSES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)


class FunctionTool(_Open):
    type: Literal["function"]  # the other tool types (web_search, file_search...) are not served here
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(_Open):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextOptions(_Open):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    previous_response_id: str | None = None
    store: bool = True
    text: TextOptions | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": "none"} turns thinking off
    # llama-server's extras, as on chat completions
    reasoning_budget: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    ignore_eos: bool = False


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_value(where, f"{where} must be a string or a list of parts")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad_value(f"{where}[{k}]", f"{where}[{k}] is a part of type {kind!r}; this model reads text only")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def input_messages(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input items as chat messages, after history (the previous response's conversation)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    calls = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            out.append({"role": item["role"], "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            for field, value in (("call_id", call["id"]), ("name", call["function"]["name"]),
                                 ("arguments", call["function"]["arguments"])):
                if not isinstance(value, str) or not value:
                    raise bad_value(f"{where}.{field}", f"{where}.{field}: a function_call needs a string "
                                    f"{field}{' (its JSON)' if field == 'arguments' else ''}")
            calls.add(call["id"])
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or item["call_id"] not in calls:
                raise bad_value(f"{where}.call_id", f"{where} answers call_id {item.get('call_id')!r}, which no "
                                "function_call of this conversation made")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item.get("output"),
                                                                                             f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier thoughts are not shown to the model again
        else:
            raise bad_value(where, f"{where} is an item of type {kind!r} (role {item.get('role')!r}), which this "
                            "server does not take (message, function_call, function_call_output)"
                            if isinstance(item, dict) else f"{where} must be an object")
    return out


def to_chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatRequest:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
                            "reasoning_budget": req.reasoning_budget, "ignore_eos": req.ignore_eos,
                            "chat_template_kwargs": req.chat_template_kwargs}
    if (req.reasoning or {}).get("effort") in ("none", "minimal"):
        body["chat_template_kwargs"] = {**(req.chat_template_kwargs or {}), "enable_thinking": False}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                                       exclude_none=True)} for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else
                                   {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                           "schema": fmt.schema_ or {}}})
    return validated(ChatRequest, {k: v for k, v in body.items() if v is not None})


def _tool_names(names: dict[str, str], tools: int) -> dict[str, str]:
    """chat's tools[k].function.name is the Responses API's tools[k].name."""
    return {**{f"tools[{k}].function": f"tools[{k}]" for k in range(tools)}, **names}


def prepare_response(state, req: ResponsesRequest):
    """(the chat preparation, the conversation this response continues)."""
    from .prepare import prepare_chat

    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = state.responses.get(req.previous_response_id)
        if found is None:
            raise APIError(400, f"previous response {req.previous_response_id!r} is not stored on this server "
                           f"(it keeps the last {state.responses.max_entries})", param="previous_response_id",
                           code="previous_response_not_found")
        history = found
    conversation = history + input_messages(req, history)
    try:
        return prepare_chat(state, to_chat_request(req, conversation)), conversation
    except APIError as e:
        raise renamed(e, _tool_names(CHAT_TO_RESPONSES, len(req.tools or ()))) from None


# -- answers ---------------------------------------------------------------------------------------------------
def _items(job: Job, text: str, *, status: str = "completed") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The output items of an answer (its message's status: "incomplete" when it was cut at the token limit),
    and the chat message it adds to the conversation."""
    thoughts, answer = job.split(text)
    content, calls = job.tool_calls(answer)
    items: list[dict[str, Any]] = []
    if thoughts:
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": thoughts}]})
    if content:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": status,
                      "role": "assistant", "content": [{"type": "output_text", "text": content, "annotations": []}]})
    for c in calls:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    return items, {"role": "assistant", "content": content, "tool_calls": calls or None}


def _response(job: Job, req: ResponsesRequest, *, status: str, output: list, reason: FinishReason | None = None,
              num_output: int = 0) -> dict[str, Any]:
    usage = {"input_tokens": len(job.prep.prompt_ids), "input_tokens_details": {"cached_tokens": job.cached},
             "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": len(job.prep.prompt_ids) + num_output}
    incomplete = {"reason": "max_output_tokens"} if reason is FinishReason.LENGTH else None
    return {"id": job.id, "object": "response", "created_at": job.created, "model": job.state.model_id,
            "status": "incomplete" if incomplete else status, "incomplete_details": incomplete, "error": None,
            "instructions": req.instructions, "previous_response_id": req.previous_response_id,
            "output": output, "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "tool_choice": _dumped(req.tool_choice) or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
            "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "metadata": {}, "store": req.store,
            "usage": usage if status != "in_progress" else None}


def _dumped(value):
    return value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value


def _finish(job: Job, req: ResponsesRequest, conversation: list, f) -> dict[str, Any]:
    items, message = _items(job, f.text, status="incomplete" if f.reason is FinishReason.LENGTH else "completed")
    if req.store:
        job.state.responses.put(job.id, conversation + [message])
    return _response(job, req, status="completed", output=items, reason=f.reason, num_output=len(f.token_ids))


async def response_answer(job: Job, req: ResponsesRequest, conversation: list) -> dict[str, Any]:
    async for _ in job.events():
        pass
    if not job.finished:
        return {}  # the client went away
    return _finish(job, req, conversation, job.finished[0])


async def response_stream(job: Job, req: ResponsesRequest, conversation: list) -> AsyncIterator[str]:
    """response.created, then the output items as they come (text deltas live unless tools may be called), then
    response.completed with the whole response."""
    seq = iter(range(1 << 62))

    def event(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n"

    live = job.prep.tool_names is None and job.prep.reasoning is None  # else: read whole at the end
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    yield event("response.created", response=_response(job, req, status="in_progress", output=[]))
    yield event("response.in_progress", response=_response(job, req, status="in_progress", output=[]))
    opened = False
    try:
        async for ev in job.events():
            if isinstance(ev, Delta):
                if live and ev.text:
                    if not opened:
                        opened = True
                        yield event("response.output_item.added", output_index=0, item={
                            "type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                            "content": []})
                        yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []})
                    yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                delta=ev.text, logprobs=[])
                continue
            final = _finish(job, req, conversation, ev)
            for index, item in enumerate(final["output"]):
                if item["type"] == "message" and live:
                    item["id"] = msg_id
                    text = item["content"][0]["text"]
                    yield event("response.output_text.done", item_id=msg_id, output_index=index, content_index=0,
                                text=text, logprobs=[])
                    yield event("response.content_part.done", item_id=msg_id, output_index=index, content_index=0,
                                part=item["content"][0])
                    yield event("response.output_item.done", output_index=index, item=item)
                    continue
                yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
                if item["type"] == "message":
                    part = item["content"][0]
                    yield event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part={**part, "text": ""})
                    yield event("response.output_text.delta", item_id=item["id"], output_index=index,
                                content_index=0, delta=part["text"], logprobs=[])
                    yield event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[])
                    yield event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part)
                elif item["type"] == "function_call":
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"], name=item["name"])
                yield event("response.output_item.done", output_index=index, item=item)
            yield event("response.completed" if final["status"] == "completed" else "response.incomplete",
                        response=final)
    except Exception as e:  # noqa: BLE001 -- headers are sent: the error goes into the stream
        err = job.failed(e)
        yield event("error", code=err.code, message=err.message, param=err.param)


__all__ = ["ResponsesRequest", "prepare_response", "response_answer", "response_stream"]
