"""A chat request's messages and tools as prompt ids, through the model's chat template (runtime.chat.ChatFormat).

A template that reads `tools` renders them itself; for one that does not, the tools are described in the system
message the way Hermes-style models are prompted, and an assistant's earlier calls are written out as the
`<tool_call>` text such a model produces.
"""
from __future__ import annotations

import inspect
from typing import Any

from staticlm.runtime.chat import ChatFormat
from staticlm.runtime.text.chat_template import Message

from .schemas import ChatMessage
from .tools import tool_call_text, tools_system_text


def _template_takes_tools(fmt: ChatFormat) -> bool:
    return "tools" in inspect.signature(fmt.prompt_ids).parameters and bool(getattr(fmt, "supports_tools", False))


def _role(m: ChatMessage) -> str:
    return "system" if m.role == "developer" else m.role


def _openai_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        d["role"], d["content"] = _role(m), m.text()
        out.append(d)
    return out


def _as_text_messages(messages: list[ChatMessage], tools: list[dict] | None,
                      system_prompt: str | None) -> list[Message]:
    """Plain (role, text) messages: tools described in the system message, earlier calls as their text."""
    out = []
    for m in messages:
        text = m.text()
        if m.tool_calls:
            text = "\n".join([text] * bool(text) + [tool_call_text(c.model_dump()) for c in m.tool_calls])
        out.append(Message(role=_role(m), content=text))
    if tools:
        head = tools_system_text(tools)
        if out and out[0].role == "system":
            out[0] = Message(role="system", content=f"{out[0].content}\n\n{head}")
        else:
            out.insert(0, Message(role="system", content=f"{system_prompt}\n\n{head}" if system_prompt else head))
    return out


def chat_prompt(fmt: ChatFormat, messages: list[ChatMessage], *, tools: list[dict] | None,
                system_prompt: str | None) -> tuple[list, dict[str, Any]]:
    """(messages, keyword arguments) for fmt.prompt_ids / fmt.fitted_prompt_ids. system_prompt: the server's
    default (--system), used when the request brings none."""
    has_system = any(_role(m) == "system" for m in messages)
    system = None if has_system else system_prompt
    plain = not tools and all(m.role in ("system", "developer", "user", "assistant") and not m.tool_calls
                              for m in messages)
    if plain:  # exactly what `staticlm generate` and the chat render
        return [Message(role=_role(m), content=m.text()) for m in messages], {"system_prompt": system}
    if _template_takes_tools(fmt) and hasattr(Message, "from_openai"):
        return ([Message.from_openai(d) for d in _openai_dicts(messages)],
                {"system_prompt": system, "tools": tools or None})
    return _as_text_messages(messages, tools, system), {"system_prompt": None}


def chat_prompt_ids(fmt: ChatFormat, messages: list[ChatMessage], *, tools: list[dict] | None,
                    system_prompt: str | None) -> list[int]:
    msgs, kwargs = chat_prompt(fmt, messages, tools=tools, system_prompt=system_prompt)
    return fmt.prompt_ids(msgs, **kwargs)


__all__ = ["chat_prompt", "chat_prompt_ids"]
