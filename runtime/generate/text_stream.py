"""One response's text, fed one token at a time: where it ends and what of it can be shown yet.

Every choice the generation loop runs (loop.py) has one, so EOS, stop
strings, the max_new_tokens limit, incremental detokenization and the final flush are decided in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from staticlm.errors import InvalidOption
from staticlm.runtime.generate.sampling import SamplingParams
from staticlm.runtime.text.detokenizer import StreamDecoder
from staticlm.runtime.text.stopping import StopStringMatcher
from staticlm.runtime.text.tokenizer import Tokenizer


class FinishReason(str, Enum):
    EOS = "eos"
    STOP_STRING = "stop_string"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidOption(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


class TextStream:
    """Push each generated token; `reason` is set once the response has ended (push nothing more then).

    ids: every token pushed (an EOS included, as the cache holds it); pieces: the text shown, in order;
    first_s / last_s: the `now` of the first and the last token pushed.
    """

    def __init__(self, tokenizer: Tokenizer, params: GenerationParams) -> None:
        self.params = params
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._decoder, self._stopper = StreamDecoder(tokenizer), StopStringMatcher(params.stop_strings)
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.reason: FinishReason | None = None
        self.first_s = self.last_s = 0.0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def push(self, token: int, *, now: float) -> str:
        """The text this token lets through ('' while a character, a word or a possible stop string is open)."""
        if self.reason is not None:
            raise RuntimeError(f"the response already ended ({self.reason.value})")
        if not self.ids:
            self.first_s = now
        self.ids.append(token)
        self.last_s = now
        if token in self._eos and not self.params.ignore_eos:
            return self._end(FinishReason.EOS, "")
        text, stopped = self._stopper.push(self._decoder.push(token))
        if stopped:  # the stop string and everything after it are never shown: nothing to flush
            self.reason = FinishReason.STOP_STRING
            return self._show(text)
        if len(self.ids) >= self.params.max_new_tokens:
            return self._end(FinishReason.LENGTH, text)
        return self._show(text)

    def cancel(self) -> str:
        """End the response here (the caller stopped it); returns the held-back text, now final."""
        return self._end(FinishReason.CANCELLED, "") if self.reason is None else ""

    def _end(self, reason: FinishReason, text: str) -> str:
        # Held back so far: bytes of a character that never completed, and text that might have begun a stop
        # string. The response is over, so both are final.
        self.reason = reason
        tail, _ = self._stopper.push(self._decoder.flush())
        return self._show(text + tail + self._stopper.flush())

    def _show(self, text: str) -> str:
        if text:
            self.pieces.append(text)
        return text


__all__ = ["FinishReason", "GenerationParams", "TextStream"]
