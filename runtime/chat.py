"""A conversation over a model's generation loop: each turn prefills only what the cache does not hold yet."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from staticlm.errors import InvalidOption
from staticlm.kv_manager import ContextFull, Overflow
from staticlm.runtime.generate.drive import GenerationResult
from staticlm.runtime.generate.generator import Generator
from staticlm.runtime.generate.text_stream import FinishReason, GenerationParams
from staticlm.runtime.text.chat_template import ChatMessage, Message, render_chat
from staticlm.runtime.text.prompt_room import max_prompt_tokens
from staticlm.runtime.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatFormat:
    """How messages become prompt ids: the model's chat template (a plain fallback without one) and tokenizer.

    chat_template: one template, or named ones ({"default": .., "tool_use": ..}) of which the one transformers
    would pick is used. Messages: `Message`s or OpenAI-shaped mappings (rendered as given, like transformers)."""

    tokenizer: Tokenizer
    chat_template: str | Mapping[str, str] | None
    bos_token: str | None
    eos_token: str | None

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads `tools` at all (without it, tools passed are silently not shown)."""
        template = self.chat_template or {}
        templates = [template] if isinstance(template, str) else list(template.values())
        return any("tools" in t for t in templates)

    def render(self, messages: Sequence[ChatMessage], *, system_prompt: str | None = None,
               tools: list[dict] | None = None, add_generation_prompt: bool = True,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text, as transformers' apply_chat_template(..., tools=tools, tokenize=False) renders it."""
        full = ([Message(role="system", content=system_prompt)] if system_prompt else []) + list(messages)
        if self.chat_template:
            return render_chat(self.chat_template, full, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token, eos_token=self.eos_token, tools=tools,
                               template_kwargs=template_kwargs)
        if tools:
            raise InvalidOption("this model has no chat template, so it cannot be given tools")
        text = "".join(f"{_field(m, 'role')}: {_field(m, 'content') or ''}\n" for m in full)
        return text + ("assistant: " if add_generation_prompt else "")

    def prompt_ids(self, messages: Sequence[ChatMessage], *, system_prompt: str | None = None,
                   tools: list[dict] | None = None, add_generation_prompt: bool = True,
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """tools: OpenAI/JSON-schema function dicts, the template's `tools` variable; messages may carry
        tool_calls (assistant) and tool_call_id/name (tool), see Message.from_openai."""
        text = self.render(messages, system_prompt=system_prompt, tools=tools,
                           add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
        # A template writes its own BOS (if any); the plain fallback gets the tokenizer's.
        return self.tokenizer.encode(text, add_special_tokens=not self.chat_template)

    def fitted_prompt_ids(self, messages: Sequence[ChatMessage], *, system_prompt: str | None, max_tokens: int,
                          tools: list[dict] | None = None,
                          template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], int]:
        """Prompt ids of at most max_tokens, and how many tokens were dropped to get there: the oldest messages go
        first (never the leading system messages, never the last one), then the start of the last message's text.
        The template's head (its system prompt, the tools) and the assistant header at the end stay, so a long
        document followed by a question keeps the question."""
        def ids_of(msgs: list[ChatMessage]) -> list[int]:
            return self.prompt_ids(msgs, system_prompt=system_prompt, tools=tools, template_kwargs=template_kwargs)

        messages = list(messages)
        num_head = next((i for i, m in enumerate(messages) if _field(m, "role") != "system"), len(messages))
        head, body = messages[:num_head], messages[num_head:]
        ids = ids_of(messages)
        num_full = len(ids)
        while len(ids) > max_tokens and len(body) > 1:
            body = body[1:]
            ids = ids_of(head + body)
        if len(ids) > max_tokens:
            *rest, last = head + body
            content = self.tokenizer.encode(_field(last, "content") or "", add_special_tokens=False)

            def with_tail(num_kept: int) -> list[int]:
                tail = self.tokenizer.decode(content[len(content) - num_kept:]) if num_kept else ""
                return ids_of([*rest, _with_content(last, tail)])

            low, high = 0, len(content)  # the most content tokens that fit: binary search, a few renders
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if len(with_tail(mid)) <= max_tokens else (low, mid - 1)
            ids = with_tail(low)
            if len(ids) > max_tokens:
                raise ContextFull(f"the chat template alone takes {len(ids)} tokens; the context holds {max_tokens}")
        return ids, num_full - len(ids)


def _field(message: ChatMessage, key: str) -> Any:
    return message.get(key) if isinstance(message, Mapping) else getattr(message, key)


def _with_content(message: ChatMessage, content: str) -> ChatMessage:
    return {**message, "content": content} if isinstance(message, Mapping) else replace(message, content=content)


class Answers(Protocol):
    """What a conversation asks of the model that opens it (runtime/model.py's Model): its generator, whose tokens
    mirror the KV (a turn rewinds to what they share), one answer streamed, and that answer's summary."""

    generator: Generator
    last_result: GenerationResult | None

    def stream(self, prompt_ids: list[int], params: GenerationParams | None = None, *,
               should_stop: Callable[[], bool] = ..., **request) -> Iterator[str]: ...


class ChatSession:
    """params: what an answer uses when a call passes none (the model's run options)."""

    def __init__(self, model: Answers, chat_format: ChatFormat, *, system_prompt: str | None = None,
                 params: GenerationParams | None = None) -> None:
        self.model, self.generator, self.format = model, model.generator, chat_format
        self.system_prompt = system_prompt
        self.params = params or GenerationParams()
        self.messages: list[Message] = []
        self.last_result: GenerationResult | None = None
        self.prompt_tokens_dropped = 0  # of the last prompt, longer than the context (slide overflow only)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.format.prompt_ids(messages, system_prompt=self.system_prompt)

    def send(self, user_text: str, params: GenerationParams | None = None, *,
             should_stop: Callable[[], bool] = lambda: False, **request) -> Iterator[str]:
        """Stream the answer to a new user message (request: num_logprobs, constraint, as Model.stream takes)."""
        if not user_text.strip():
            raise InvalidOption("the message is empty")
        return self._answer(self.messages + [Message(role="user", content=user_text)], params, should_stop,
                            **request)

    def regenerate(self, params: GenerationParams | None = None, *,
                   should_stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Answer the last user message again; the KV rewinds to before the old answer, no re-prefill."""
        if not self.messages or self.messages[-1].role != "assistant":
            raise InvalidOption("there is no answer to regenerate")
        return self._answer(self.messages[:-1], params, should_stop)

    def _answer(self, messages: list[Message], params: GenerationParams | None,
                should_stop: Callable[[], bool], **request) -> Iterator[str]:
        # Render before touching state: a prompt that cannot be built leaves the conversation as it was.
        params = params or self.params
        ids = self.prompt_ids(messages)
        self.prompt_tokens_dropped = 0
        engine = self.generator.engine
        if len(ids) > engine.max_context and engine.options.overflow is Overflow.SLIDE:
            # Longer than the whole context: sliding it through would keep only its end, template head lost. Fit
            # it instead, with room for the answer. (A long conversation slides as it grows, and stays cached.)
            room = max_prompt_tokens(max_context=engine.max_context, max_new_tokens=params.max_new_tokens)
            ids, self.prompt_tokens_dropped = self.format.fitted_prompt_ids(messages, system_prompt=self.system_prompt,
                                                                            max_tokens=room)
        pieces: list[str] = []
        try:
            for chunk in self.model.stream(ids, params, should_stop=should_stop, **request):
                pieces.append(chunk)
                yield chunk
        except KeyboardInterrupt:
            self._commit(messages, "".join(pieces))
            raise
        self.last_result = self.model.last_result
        self._commit(messages, self.last_result.text)

    def _commit(self, messages: list[Message], answer: str) -> None:
        # A stopped answer is kept as far as it got, like every chat app does.
        self.messages = messages + [Message(role="assistant", content=answer)]

    def reset(self) -> None:
        self.messages = []
        self.generator.reset()

    @property
    def num_context_tokens(self) -> int:
        return len(self.generator.tokens)


__all__ = ["ChatFormat", "ChatSession", "FinishReason"]
