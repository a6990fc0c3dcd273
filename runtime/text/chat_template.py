"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

Same sandboxed Jinja environment, same extra filter and globals, same variables (messages, tools, documents,
add_generation_prompt, the special tokens and any extra template kwargs), and the messages prepared the same way
(keys whose value is None dropped, reasoning aliased), so a model's own template produces byte-identical prompts
here and in transformers.

Messages may be `Message`s or OpenAI-shaped mappings. A `Message` carries what the OpenAI chat API carries:
an assistant turn's `tool_calls`, a tool result's `tool_call_id`/`name`; `Message.from_openai` reads one request
message, tools are the JSON-schema dicts of an OpenAI request's `tools` list.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from staticlm.errors import InvalidOption, UserError

ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
# Names a message's reasoning arrives under; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Used when a model ships no template of its own.
DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ChatMessage = Any  # a Message or an OpenAI-shaped mapping (what render_chat and ChatFormat take)


class ChatTemplateError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant turn. `arguments` is what the template sees: a dict (what templates
    expect; `from_openai` parses OpenAI's JSON string into one) or a string, passed as given."""

    name: str
    arguments: Mapping[str, Any] | str
    id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidOption("a tool call needs a function name")
        if not isinstance(self.arguments, (Mapping, str)):
            raise InvalidOption("tool call arguments must be an object or a string, "
                                f"got {type(self.arguments).__name__}")

    @classmethod
    def from_openai(cls, data: Mapping[str, Any]) -> ToolCall:
        """`{"id": .., "type": "function", "function": {"name": .., "arguments": "<json>" or {..}}}`."""
        fn = data.get("function") if isinstance(data, Mapping) else None
        if not isinstance(fn, Mapping):
            raise InvalidOption("a tool call must be {'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
        arguments = fn.get("arguments")
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments  # not a JSON object: kept as text
        return cls(name=fn.get("name"), arguments=arguments, id=data.get("id"))

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI shape chat templates read (`tool_call.function.name`, `.arguments`)."""
        out: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
        out["type"] = "function"
        args = self.arguments if isinstance(self.arguments, str) else _plain(self.arguments)
        out["function"] = {"name": self.name, "arguments": args}
        return out


@dataclass(frozen=True)
class Message:
    """A chat message. `content` may be None only where OpenAI allows it (an assistant turn of tool calls);
    tool_calls may be given as ToolCalls or OpenAI dicts; optional fields left unset are not shown to templates."""

    role: str
    content: str | None = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None  # a tool result: the function's name
    reasoning_content: str | None = None  # an assistant turn's reasoning, for templates that show it

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidOption(f"message role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.content is not None and not isinstance(self.content, str):
            raise InvalidOption(f"message content must be text, got {type(self.content).__name__}")
        if self.tool_calls and self.role != "assistant":
            raise InvalidOption(f"only an assistant message carries tool calls, not a {self.role} message")
        calls = tuple(c if isinstance(c, ToolCall) else ToolCall.from_openai(c) for c in self.tool_calls or ())
        object.__setattr__(self, "tool_calls", calls)
        for key in ("tool_call_id", "name", "reasoning_content"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise InvalidOption(f"message {key} must be text, got {type(value).__name__}")

    @classmethod
    def from_openai(cls, data: Mapping[str, Any]) -> Message:
        """One message of an OpenAI chat request: content as text or a list of text parts (joined), `developer`
        read as `system`, tool calls with JSON-string arguments parsed to objects."""
        if not isinstance(data, Mapping):
            raise InvalidOption(f"a chat message must be an object, got {type(data).__name__}")
        role = data.get("role")
        role = _ROLE_ALIASES.get(role, role)
        content = data.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, Mapping)]
            if len(parts) != len(content) or any(not isinstance(p, str) for p in parts) or \
                    any(p.get("type", "text") != "text" for p in content):
                raise InvalidOption("only text content parts are supported")
            content = "".join(parts)
        reasoning = next((data[k] for k in _REASONING_FIELDS if data.get(k) is not None), None)
        return cls(role=role, content=content, tool_calls=tuple(data.get("tool_calls") or ()),
                   tool_call_id=data.get("tool_call_id"), name=data.get("name"), reasoning_content=reasoning)

    def to_dict(self) -> dict[str, Any]:
        """What the template sees: role and content, plus only the optional fields that are set."""
        out: dict[str, Any] = {"role": self.role}
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (transformers' assistant mask marker) and renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """The `dict` global transformers gives templates: construction only, no attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` refusing underscore names, as transformers' is (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- Jinja's own signature trick (namespace(self=..))
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store attribute {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change prompts: transformers overrides it the same way.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "unknown error"


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: "
                                f"{_one_line(e.message or '')}") from None


def _plain(value: Any) -> Any:
    """Plain JSON-like data (dicts, lists, tuples, scalars), as transformers rebuilds every template input."""
    if isinstance(value, Message | ToolCall):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    item = getattr(value, "item", None)  # numpy scalars
    return _plain(item()) if callable(item) else f"<{type(value).__name__}>"


def _as_dict(message: ChatMessage) -> dict[str, Any]:
    if isinstance(message, Message):
        out = message.to_dict()
    elif isinstance(message, Mapping):
        # Like transformers: a key whose value is None (OpenAI's content=None, tool_calls=None) is left out.
        out = {k: _plain(v) for k, v in message.items() if v is not None}
    else:
        raise InvalidOption(f"a chat message must be a Message or a mapping, got {type(message).__name__}")
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:  # transformers fills the standard name and gpt-oss's `thinking`
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def select_template(template: str | Mapping[str, str], *, tools: Sequence[Any] | None = None) -> str:
    """A model's one template, or out of named ones (GGUF `tokenizer.chat_template.<name>`, a tokenizer_config
    list) the one transformers picks: `tool_use` when tools are passed and it exists, else `default`."""
    if isinstance(template, str):
        return template
    if tools is not None and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ChatTemplateError(f"the model has named chat templates ({', '.join(sorted(template))}) but no default")


def render_chat(template: str | Mapping[str, str], messages: Sequence[ChatMessage], *, add_generation_prompt: bool,
                bos_token: str | None = None, eos_token: str | None = None, tools: Sequence[Any] | None = None,
                documents: Sequence[Any] | None = None, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text. tools: JSON-schema dicts (`{"type": "function", "function": {"name", "description",
    "parameters"}}`), shown to the template as `tools`; template_kwargs: extra variables (e.g. enable_thinking),
    which override the special tokens as transformers' do."""
    compiled = _compile(select_template(template, tools=tools))
    if tools is not None and any(not isinstance(t, Mapping) for t in tools):
        raise InvalidOption("tools must be JSON-schema objects")
    # Like transformers' special_tokens_map: an unset token is left undefined (renders ''), never "None".
    variables = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    variables.update(_plain(dict(template_kwargs or {})))
    chat = [_as_dict(m) for m in messages]
    try:
        return compiled.render(messages=chat, tools=_plain(tools),
                               documents=_plain(documents), add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {_one_line(e.message or type(e).__name__)}") from None
    except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
        # A template can trip over message shapes it did not expect; report it as the template's fault.
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(str(e))}") from None


__all__ = ["ChatMessage", "ChatTemplateError", "DEFAULT_CHATML", "Message", "ROLES", "ToolCall", "render_chat",
           "select_template"]
