"""Tool calls out of a model's text: Qwen/Hermes `<tool_call>{...}</tool_call>` blocks, or Llama-3's bare JSON
(`{"name": ..., "parameters": {...}}`, several joined by `;`, optionally after `<|python_tag|>`)."""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


def _call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    """An OpenAI tool call from a decoded {"name", "arguments"|"parameters"} object of a known tool."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str, *, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the calls, or None when there is none; the calls). Text naming no known tool, or that
    is not a call at all, stays content and gives no calls."""
    if "<tool_call>" in text:
        calls = [_call(_loads(m.group(1)), tool_names) for m in HERMES.finditer(text)]
        if calls and all(calls):
            content = HERMES.sub("", text).strip()
            return content or None, calls
        return text, []
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if body.startswith("{"):
        whole = _loads(body)
        parts = [whole] if whole is not None else [_loads(p) for p in body.split(";") if p.strip()]
        calls = [_call(p, tool_names) for p in parts]
        if calls and all(calls):
            return None, calls
    return text, []


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """Hermes' tool prompt, shortened, for a chat template that does not render tools itself (OpenAI tool dicts)."""
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False, separators=(",", ":")) for t in tools)
    return (f"You may call these functions:\n<tools>\n{listing}\n</tools>\nTo call one, answer with "
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tool_call_text(call: dict[str, Any]) -> str:
    """An assistant's earlier call, as the model would have written it (for templates without tool_calls)."""
    fn = call.get("function", {})
    args = fn.get("arguments", "{}")
    args = _loads(args) if isinstance(args, str) else args
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + \
        "\n</tool_call>"


__all__ = ["parse_tool_calls", "tool_call_text", "tools_system_text"]
