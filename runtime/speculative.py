"""Speculative decoding on static graphs: drafts verified in the AR=N graph's otherwise padded rows.

A step feeds the last sampled token plus up to N-1 draft tokens to the smallest verify graph that
holds them. The model writes their K/V into the slot rows right after the window; `commit(m)`
keeps the accepted ones and rejected rows are overwritten by the next step, never copied.
Acceptance follows speculative sampling (Leviathan et al.): accept a draft token x with
probability min(1, p(x)/q(x)); on rejection, draw from the normalised positive part of p - q.
With greedy sampling p is one-hot, so this is exact-match and the output equals plain greedy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .sampling import SamplingParams, distribution

if TYPE_CHECKING:
    from .generator import Generator


class Drafter(Protocol):
    def propose(self, context: list[int], num_tokens: int, *, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        """Up to num_tokens draft tokens after context, and their proposal distributions q (None: point masses)."""


@dataclass
class DraftLength:
    """BASS's Algorithm 1 (l0 = 7, l_incre = 2, l_mod = 10, l_limit = 32), or a fixed length."""
    initial: int = 7
    increment: int = 2
    modulus: int = 10
    limit: int = 32
    fixed: bool = False
    current: int = field(init=False)
    _decreasing: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.current = self.initial

    def update(self, num_accepted: int, num_drafted: int | None = None) -> None:
        """num_drafted: what was actually drafted (the verify graphs may have cut `current`); default current."""
        if self.fixed:
            return
        if num_accepted >= (self.current if num_drafted is None else num_drafted):
            self.current = min(self.current + self.increment, self.limit)
            self._decreasing = 0
        else:
            shrunk = self.current - math.ceil(self.current / self.modulus) - self._decreasing
            self.current = max(1, num_accepted, shrunk)
            self._decreasing = 1


@dataclass
class SpeculationStats:
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))


def fit_to_verify_graphs(num_draft: int, verify_lens: tuple[int, ...]) -> int:
    """A draft length mapped onto the exported verify graphs: the longest that fills one exactly (a few
    more tokens would pay for the next graph's padding rows too); below the smallest graph, itself."""
    fitting = [ar - 1 for ar in verify_lens if ar - 1 <= num_draft]
    return max(fitting) if fitting else num_draft


def speculation_pays(cost_ratio: float | None, *, acceptance: float, num_draft: int) -> bool:
    """Expected tokens per verify step, (1 - a^(k+1)) / (1 - a), against its measured cost in decode steps."""
    if cost_ratio is None:
        return True  # not measured yet: try it
    a = min(acceptance, 0.999)
    return (1 - a ** (num_draft + 1)) / (1 - a) > cost_ratio


def accept_draft(logits: np.ndarray, draft: list[int], proposals: list[np.ndarray] | None, *,
                 params: SamplingParams, context: list[int], rng: np.random.Generator) -> tuple[list[int], int]:
    """Speculative sampling over one sequence's verify rows: (accepted draft tokens, the next token).

    logits [>= len(draft) + 1, V]: row i scores the token after input i (input 0 is the last sampled token).
    """
    accepted: list[int] = []
    for i, token in enumerate(draft):
        p = distribution(logits[i], params, history=context + accepted)
        q = proposals[i] if proposals is not None else None
        q_token = q[token] if q is not None else 1.0
        if rng.random() * q_token < p[token]:  # accept with probability min(1, p/q)
            accepted.append(token)
            continue
        residual = np.maximum(p - q, 0.0) if q is not None else p.copy()
        if q is None:
            residual[token] = 0.0
        return accepted, (_draw(residual, rng) if residual.sum() > 0 else _draw(p, rng))
    # Every draft accepted: the last row gives a bonus token for free.
    return accepted, _draw(distribution(logits[len(draft)], params, history=context + accepted), rng)


class Speculator:
    """Drafts, verifies, accepts; and only speculates while it pays.

    A verify step costs more than a decode step (here AR=8 is ~1.5x), so drafts that are rarely
    accepted (open chat with prompt lookup) would make decoding slower. The expected tokens per step
    under the running acceptance rate a, (1 - a^(k+1)) / (1 - a), is weighed against the measured cost
    ratio of the verify graph; when it does not pay, plain decoding runs and a probe every
    `probe_every` steps keeps the estimate fresh.
    """

    def __init__(self, drafter: Drafter, *, length: DraftLength | None = None, probe_every: int = 8) -> None:
        self.drafter = drafter
        self.length = length or DraftLength()
        self.stats = SpeculationStats()
        self.probe_every = probe_every
        self._acceptance = 0.6  # prior: optimistic, so speculation gets tried
        self._num_skipped = 0

    def _pays(self, engine, num_draft: int) -> bool:
        return speculation_pays(engine.verify_cost_ratio(engine.verify_len(num_draft + 1)),
                                acceptance=self._acceptance, num_draft=num_draft)

    def step(self, gen: Generator, params: SamplingParams) -> list[int] | None:
        """One draft-and-verify step after gen's pending token; the new tokens, or None to decode plainly."""
        engine, last = gen.engine, gen.pending_token
        if last is None or not engine.verify_lens:
            return None
        context = gen.tokens + [last]
        max_draft = fit_to_verify_graphs(self.length.current, engine.verify_lens)
        draft, proposals = self.drafter.propose(context, max_draft, params=params, rng=gen.rng)
        while draft and engine.verify_len(len(draft) + 1) is None:
            draft = draft[:-1]  # near the end of the ladder a shorter verify graph may still fit
        if not draft:
            return None
        if not self._pays(engine, len(draft)):
            self._num_skipped += 1
            if self._num_skipped % self.probe_every:
                return None
        logits = engine.verify([last, *draft])  # [n, V]: row i predicts the token after input i
        accepted, nxt = accept_draft(logits, draft, proposals, params=params, context=context, rng=gen.rng)
        engine.commit(1 + len(accepted))
        gen.commit_speculated(last, accepted, nxt)
        self.length.update(len(accepted), len(draft))
        self._acceptance = 0.8 * self._acceptance + 0.2 * len(accepted) / len(draft)
        self.stats.num_steps += 1
        self.stats.num_drafted += len(draft)
        self.stats.num_accepted += len(accepted)
        return [*accepted, nxt]
