"""Chat templates rendered the way transformers' `apply_chat_template` renders them.

Same sandboxed Jinja environment, same extra filter and globals, same variables, so a model's own
template produces byte-identical prompts here and in transformers.
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

# Used when a model ships no template of its own.
DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidOption(f"message role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise InvalidOption(f"message content must be text, got {type(self.content).__name__}")


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (transformers' assistant mask marker) and renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


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
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: "
                                f"{_one_line(e.message or '')}") from None


def _as_dict(message: Mapping[str, Any] | Message) -> dict[str, Any]:
    if isinstance(message, Message):
        return {"role": message.role, "content": message.content}
    if isinstance(message, Mapping):
        return dict(message)
    raise InvalidOption(f"a chat message must be a Message or a mapping, got {type(message).__name__}")


def render_chat(template: str, messages: Sequence[Mapping[str, Any] | Message], *, add_generation_prompt: bool,
                bos_token: str | None = None, eos_token: str | None = None) -> str:
    compiled = _compile(template)
    # Like transformers' special_tokens_map: an unset token is left undefined (renders ''), never "None".
    tokens = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    try:
        return compiled.render(messages=[_as_dict(m) for m in messages], tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **tokens)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {_one_line(e.message or type(e).__name__)}") from None
    except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
        # A template can trip over message shapes it did not expect; report it as the template's fault.
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {_one_line(str(e))}") from None


__all__ = ["ChatTemplateError", "DEFAULT_CHATML", "Message", "ROLES", "render_chat"]
