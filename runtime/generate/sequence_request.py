"""What a caller hands the generation loop, and the events it gets back (see loop.py).

A request is one prompt and n choices. Events arrive on the loop's thread through `on_event`; a front end
passes them on to wherever its client waits (an asyncio queue, for the HTTP server).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from staticlm.runtime.generate.text_stream import FinishReason, GenerationParams

MAX_TOP_LOGPROBS = 20


class Constraint(Protocol):
    """Structured output: which tokens may come next (a grammar, a JSON schema), fed each token chosen."""

    def allowed(self, vocab_size: int) -> np.ndarray | None:
        """[V] bool: the tokens allowed next (None: any)."""

    def consume(self, token_id: int) -> None:
        """The token chosen (one the last mask allowed)."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # of the model's distribution (raw logits, before sampling warpers and constraints)
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens and their logprobs, likeliest first


@dataclass(frozen=True)
class Admitted:
    """The request left the queue: its cached prefix is known, and the rest is prefilled from here (in chunks,
    between the decode steps of the rows already running)."""

    num_prompt_tokens: int
    num_cached_tokens: int  # of which the prompt cache held (not prefilled)
    time: float  # time.perf_counter()


@dataclass(frozen=True)
class Delta:
    """Text of one choice that can be shown now, and the tokens since the last delta."""

    choice: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]  # empty unless logprobs were asked for
    time: float


@dataclass(frozen=True)
class Finished:
    choice: int
    reason: FinishReason
    token_ids: tuple[int, ...]  # every token of the choice (an EOS included)
    text: str
    time: float
    first_time: float = 0.0  # time.perf_counter() of its first token (0.0: it had none)


@dataclass(frozen=True)
class Failed:
    """The request could not run (a user error, e.g. a full context) or the engine broke; no more events."""

    error: BaseException


Event = Admitted | Delta | Finished | Failed


@dataclass(eq=False)
class SequenceRequest:
    prompt_ids: list[int]
    params: GenerationParams
    on_event: Callable[[Event], None]
    num_choices: int = 1
    num_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k likeliest
    constraint: Callable[[], Constraint] | None = None  # a fresh constraint per choice
    cancelled: bool = field(default=False, init=False)

    def cancel(self) -> None:
        """Any thread: the loop frees the request's rows (or drops it from the queue) at the next step."""
        self.cancelled = True


def token_logprob(logits: np.ndarray, token_id: int, *, num_top: int) -> TokenLogprob:
    """log-softmax of logits [V] at token_id, and the num_top likeliest tokens."""
    x = np.asarray(logits, np.float64)
    top = x.max()
    log_z = top + np.log(np.exp(x - top).sum())
    best: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        k = min(num_top, x.size)
        ids = np.argpartition(-x, k - 1)[:k]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        best = tuple((int(i), float(x[i] - log_z)) for i in ids)
    return TokenLogprob(token_id=int(token_id), logprob=float(x[token_id] - log_z), top=best)


__all__ = ["Admitted", "Constraint", "Delta", "Event", "Failed", "Finished", "MAX_TOP_LOGPROBS", "SequenceRequest",
           "TokenLogprob", "token_logprob"]
