"""A conversation over a Generator: each turn prefills only what the cache does not hold yet."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from staticlm.errors import InvalidOption

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


class ChatSession:
    """params: what an answer uses when a call passes none (the model's run options)."""

    def __init__(self, generator: Generator, chat_format: ChatFormat, *, system_prompt: str | None = None,
                 params: GenerationParams | None = None) -> None:
        self.generator, self.format = generator, chat_format
        self.system_prompt = system_prompt
        self.params = params or GenerationParams()
        self.messages: list[Message] = []
        self.last_result: GenerationResult | None = None

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
        ids = self.prompt_ids(messages)
        pieces: list[str] = []
        try:
            for chunk in self.generator.stream(ids, params or self.params, should_stop=should_stop):
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
