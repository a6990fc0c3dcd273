"""A conversation over a Generator: each turn prefills only what the cache does not hold yet."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from staticlm.errors import InvalidOption
from staticlm.kv_manager import ContextFull, Overflow

from .chat_template import Message, render_chat
from .generator import FinishReason, GenerationParams, GenerationResult, Generator
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatFormat:
    """How messages become prompt ids: the model's chat template (a plain fallback without one) and tokenizer."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def prompt_ids(self, messages: list[Message], *, system_prompt: str | None = None) -> list[int]:
        full = ([Message(role="system", content=system_prompt)] if system_prompt else []) + list(messages)
        if self.chat_template:
            text = render_chat(self.chat_template, full, add_generation_prompt=True, bos_token=self.bos_token,
                               eos_token=self.eos_token)
            return self.tokenizer.encode(text, add_special_tokens=False)
        text = "".join(f"{m.role}: {m.content}\n" for m in full) + "assistant: "
        return self.tokenizer.encode(text, add_special_tokens=True)

    def fitted_prompt_ids(self, messages: list[Message], *, system_prompt: str | None,
                          max_tokens: int) -> tuple[list[int], int]:
        """Prompt ids of at most max_tokens, and how many tokens were dropped to get there: the oldest messages go
        first (never the last one), then the start of the last message's text. The template's head (its system
        prompt) and the assistant header at the end stay, so a long document followed by a question keeps the
        question."""
        ids = self.prompt_ids(messages, system_prompt=system_prompt)
        num_full, messages = len(ids), list(messages)
        while len(ids) > max_tokens and len(messages) > 1:
            messages = messages[1:]
            ids = self.prompt_ids(messages, system_prompt=system_prompt)
        if len(ids) > max_tokens:
            *rest, last = messages
            content = self.tokenizer.encode(last.content, add_special_tokens=False)

            def with_tail(num_kept: int) -> list[int]:
                tail = self.tokenizer.decode(content[len(content) - num_kept:]) if num_kept else ""
                return self.prompt_ids([*rest, Message(role=last.role, content=tail)], system_prompt=system_prompt)

            low, high = 0, len(content)  # the most content tokens that fit: binary search, a few renders
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if len(with_tail(mid)) <= max_tokens else (low, mid - 1)
            ids = with_tail(low)
            if len(ids) > max_tokens:
                raise ContextFull(f"the chat template alone takes {len(ids)} tokens; the context holds {max_tokens}")
        return ids, num_full - len(ids)


class ChatSession:
    """params: what an answer uses when a call passes none (the model's run options)."""

    def __init__(self, generator: Generator, chat_format: ChatFormat, *, system_prompt: str | None = None,
                 params: GenerationParams | None = None) -> None:
        self.generator, self.format = generator, chat_format
        self.system_prompt = system_prompt
        self.params = params or GenerationParams()
        self.messages: list[Message] = []
        self.last_result: GenerationResult | None = None
        self.prompt_tokens_dropped = 0  # of the last prompt, longer than the context (slide overflow only)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.format.prompt_ids(messages, system_prompt=self.system_prompt)

    def send(self, user_text: str, params: GenerationParams | None = None, *,
             should_stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Stream the answer to a new user message."""
        if not user_text.strip():
            raise InvalidOption("the message is empty")
        return self._answer(self.messages + [Message(role="user", content=user_text)], params, should_stop)

    def regenerate(self, params: GenerationParams | None = None, *,
                   should_stop: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Answer the last user message again; the KV rewinds to before the old answer, no re-prefill."""
        if not self.messages or self.messages[-1].role != "assistant":
            raise InvalidOption("there is no answer to regenerate")
        return self._answer(self.messages[:-1], params, should_stop)

    def _answer(self, messages: list[Message], params: GenerationParams | None,
                should_stop: Callable[[], bool]) -> Iterator[str]:
        # Render before touching state: a prompt that cannot be built leaves the conversation as it was.
        params = params or self.params
        ids = self.prompt_ids(messages)
        self.prompt_tokens_dropped = 0
        engine = self.generator.engine
        if len(ids) > engine.max_context and engine.options.overflow is Overflow.SLIDE:
            # Longer than the whole context: sliding it through would keep only its end, template head lost. Fit
            # it instead, with room for the answer. (A long conversation slides as it grows, and stays cached.)
            room = engine.max_context - min(params.max_new_tokens, engine.max_context // 4)
            ids, self.prompt_tokens_dropped = self.format.fitted_prompt_ids(messages, system_prompt=self.system_prompt,
                                                                            max_tokens=room)
        pieces: list[str] = []
        try:
            for chunk in self.generator.stream(ids, params, should_stop=should_stop):
                pieces.append(chunk)
                yield chunk
        except KeyboardInterrupt:
            self._commit(messages, "".join(pieces))
            raise
        self.last_result = self.generator.last_result
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
