"""One choice of a request while the generation loop runs it: its tokens, its text, and how a token is chosen.

Pure per-sequence state and the post-processing of a step (loop.py): the constraint's mask, sampling, the
logprobs asked for, the text a stop string lets through. No engine here; the loop decides where the row runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from staticlm.runtime.generate.sampling import sample
from staticlm.runtime.generate.sequence_request import Constraint, SequenceRequest, TokenLogprob, token_logprob
from staticlm.runtime.generate.text_stream import TextStream


@dataclass(eq=False)
class RunningSequence:
    request: SequenceRequest
    choice: int
    stream: TextStream
    rng: np.random.Generator
    constraint: Constraint | None
    history: list[int]  # prompt + tokens so far (the penalties' and the drafters' view)
    num_fed: int = 0  # of the tokens chosen, how many the row's KV holds (all but the last, while it decodes)
    unsent_ids: list[int] = field(default_factory=list)  # tokens pushed since the last delta
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    solo: bool = False  # decoding on the loop's one-sequence lane (its batch row holds nothing yet)
    num_mirrors: int = 0  # the choices after this one that get its answer (greedy choices: the same tokens)

    @property
    def choices(self) -> range:
        """The request's choices this sequence answers."""
        return range(self.choice, self.choice + 1 + self.num_mirrors)

    @property
    def pending(self) -> int:
        """The token chosen last, which the next step feeds."""
        return self.history[-1]

    @property
    def previous(self) -> int:
        """The last token the row's KV holds (the one the pending token runs beside, Engine.pairs_rows)."""
        return self.history[-2]

    @property
    def exact(self) -> bool:
        """Whether its rows must come out to the same bits whatever step they run in (Engine.pairs_rows): a greedy
        choice is an argmax, which a last-bit difference flips at a near-tie; a sampled one only moves its draw's
        thresholds by as much, so its batch steps need not pay for a paired row."""
        return self.request.params.sampling.is_greedy

    @property
    def plain(self) -> bool:
        """Whether every step's token may come from speculation: no grammar to check it, no logprobs to report."""
        return self.constraint is None and self.request.num_logprobs is None


def new_sequences(request: SequenceRequest, *, tokenizer, prompt_ids: list[int],
                  mirrored: bool = False) -> list[RunningSequence]:
    """The request's choices; a seeded request's choice c draws from (seed, c), choice 0 from seed itself.
    mirrored: one sequence whose answer every choice gets (a greedy request's choices are the same tokens)."""
    seed = request.params.sampling.seed
    num = 1 if mirrored else request.num_choices
    return [RunningSequence(request=request, choice=c, stream=TextStream(tokenizer, request.params),
                            rng=np.random.default_rng(seed if seed is None or c == 0 else (seed, c)),
                            constraint=request.constraint() if request.constraint else None,
                            history=list(prompt_ids), num_mirrors=request.num_choices - num)
            for c in range(num)]


def choose(seq: RunningSequence, logits: np.ndarray) -> int | None:
    """The next token from logits [V], under the sequence's constraint (None: the grammar cannot go on)."""
    masked = logits
    if seq.constraint is not None:
        allowed = seq.constraint.allowed(logits.shape[-1])  # [V] bool
        if allowed is not None:
            if not allowed.any():
                return None
            masked = np.where(allowed, logits, -np.inf)
    token = sample(masked, seq.request.params.sampling, rng=seq.rng, history=seq.history)
    if seq.constraint is not None:
        seq.constraint.consume(token)
    if seq.request.num_logprobs is not None:
        seq.unsent_logprobs.append(token_logprob(logits, token, num_top=seq.request.num_logprobs))
    return token


def push(seq: RunningSequence, token: int, *, now: float) -> str:
    """Record a chosen token; the text it lets through (the stream's reason is set once the choice ended)."""
    seq.history.append(token)
    seq.unsent_ids.append(token)
    return seq.stream.push(token, now=now)


__all__ = ["RunningSequence", "choose", "new_sequences", "push"]
