"""Tool calls out of a model's text, in the forms the chat-template families produce:

- Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- Llama 3: bare JSON `{"name": ..., "parameters": {...}}` (several joined by `;` or new lines, or a JSON list),
  optionally after `<|python_tag|>`;
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`;
- a fenced ```json block holding such an object (or a list of them), which small models write when asked for a
  tool in a template they were not tuned on.

JSON is read with the decoder itself (raw_decode), never by matching braces, so strings holding braces, quotes,
fences or tags stay whole. A call must name a declared tool and carry its arguments object; anything else (an
undeclared tool, a truncated block) stays in the content as text.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
FENCE = "```"
PYTHON_TAG = "<|python_tag|>"
MARKERS = re.compile(r"<tool_call>|\[TOOL_CALLS\]|```")
FENCE_HEAD = re.compile(r"```[ \t]*(?:json|tool_call|tool_code|javascript)?[ \t]*\r?\n?", re.IGNORECASE)
MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})\[ARGS\]")
_DECODER = json.JSONDecoder()


def _call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    """An OpenAI tool call from a decoded {"name", "arguments"|"parameters"} object of a declared tool."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]  # {"type": "function", "function": {...}}, OpenAI's own shape
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return None
    args = obj[key]
    if isinstance(args, str):  # some models emit the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return make_call(obj["name"], args)


def make_call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _calls(obj: Any, names: set[str]) -> list[dict[str, Any]] | None:
    """A call object, or a non-empty list of them, all of declared tools (else None)."""
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(o, names) for o in items]
    return calls if calls and all(calls) else None


def _json_at(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value that starts at text[i] (after whitespace), and where it ends."""
    while i < len(text) and text[i].isspace():
        i += 1
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _hermes(text: str, at: int, names: set[str]):
    parsed = _json_at(text, at + len(HERMES_OPEN))
    if parsed is None:
        return None
    end = _skip_space(text, parsed[1])
    if text.startswith(HERMES_CLOSE, end):
        end += len(HERMES_CLOSE)
    elif end != len(text):  # a block the model did not close is a call only at the very end
        return None
    calls = _calls(parsed[0], names)
    return (end, calls) if calls else None


def _mistral(text: str, at: int, names: set[str]):
    start = at + len(MISTRAL)
    named = MISTRAL_NAMED.match(text, start)
    if named:  # [TOOL_CALLS]name[ARGS]{...}
        parsed = _json_at(text, named.end())
        if parsed is None or not isinstance(parsed[0], dict):
            return None
        calls = _calls({"name": named.group(1), "arguments": parsed[0]}, names)
        return (parsed[1], calls) if calls else None
    parsed = _json_at(text, start)
    if parsed is None:
        return None
    calls = _calls(parsed[0], names)
    return (parsed[1], calls) if calls else None


def _fenced(text: str, at: int, names: set[str]):
    head = FENCE_HEAD.match(text, at)
    parsed = _json_at(text, head.end()) if head else None
    if parsed is None:
        return None
    end = _skip_space(text, parsed[1])
    if not text.startswith(FENCE, end):
        return None
    calls = _calls(parsed[0], names)
    return (end + len(FENCE), calls) if calls else None


PARSERS = {HERMES_OPEN: _hermes, MISTRAL: _mistral, FENCE: _fenced}


def _bare(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """Llama 3's form: the whole answer is JSON calls, one or more (`;`, `,` or new lines between them)."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    i, calls = _skip_space(body, 0), []
    if i == len(body) or body[i] not in "{[":
        return None
    while i < len(body):
        parsed = _json_at(body, i)
        found = _calls(parsed[0], names) if parsed else None
        if not found:
            return None
        calls += found
        i = _skip_space(body, parsed[1])
        if i < len(body) and body[i] in ";,":
            i = _skip_space(body, i + 1)
    return calls


def parse_tool_calls(text: str, *, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the calls, or None when there is none; the calls, in order). Text that is no call of a
    declared tool stays content; with no call at all, the text comes back unchanged."""
    spans, calls, pos = [], [], 0
    while (m := MARKERS.search(text, pos)) is not None:
        found = PARSERS[m.group(0)](text, m.start(), tool_names)
        if found is None:
            pos = m.start() + 1
            continue
        end, block = found
        spans.append((m.start(), end))
        calls += block
        pos = end
    if not calls:
        bare = _bare(text, tool_names)
        return (None, bare) if bare else (text, [])
    kept, last = [], 0
    for start, end in spans:
        kept.append(text[last:start])
        last = end
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


__all__ = ["make_call", "parse_tool_calls"]
