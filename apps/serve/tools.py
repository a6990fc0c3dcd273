"""Tools in the prompt of a template that does not render them: the Hermes-style description, earlier calls as
the text such a model writes. (Reading calls out of an answer is tool_calls.py's.)"""
from __future__ import annotations

import json
from typing import Any

from .tool_calls import parse_tool_calls


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """Hermes' tool prompt, shortened, for a chat template that does not render tools itself (OpenAI tool dicts)."""
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False, separators=(",", ":")) for t in tools)
    return (f"You may call these functions:\n<tools>\n{listing}\n</tools>\nTo call one, answer with "
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tool_call_text(call: dict[str, Any]) -> str:
    """An assistant's earlier call, as the model would have written it (for templates without tool_calls)."""
    fn = call.get("function", {})
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # kept as the string it was
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + \
        "\n</tool_call>"


__all__ = ["parse_tool_calls", "tool_call_text", "tools_system_text"]
