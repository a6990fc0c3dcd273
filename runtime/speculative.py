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
from collections.abc import Callable
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


@dataclass
class AcceptanceProfile:
    """How often draft position i was offered (every earlier one accepted) and accepted, over past steps.

    Prompt-lookup drafts are right for a run of tokens or wrong from the start, which one acceptance rate
    (the geometric model) undervalues for long drafts and overvalues for short ones. The product of the
    per-position rates (Laplace-smoothed) gives the expected accepted length of a k-token draft instead.
    """
    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    decay: float = 0.9  # per step: the last ~10 steps count, so a change of task (rewrite -> chat) shows soon

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.offered = [n * self.decay for n in self.offered] + [0.0] * max(0, num_drafted - len(self.offered))
        self.accepted = [n * self.decay for n in self.accepted] + [0.0] * max(0, num_drafted - len(self.accepted))
        for i in range(min(num_accepted + 1, num_drafted)):
            self.offered[i] += 1
        for i in range(num_accepted):
            self.accepted[i] += 1

    def expected_tokens(self, num_draft: int) -> float:
        """Tokens a step yields with num_draft drafts: the accepted ones plus the one the verify row adds."""
        total, survive, rate = 1.0, 1.0, 0.5
        for i in range(num_draft):
            if i < len(self.offered):  # positions never offered keep the last rate seen
                rate = (self.accepted[i] + 1) / (self.offered[i] + 2)
            survive *= rate
            total += survive
        return total


def cost_aware_length(profile: AcceptanceProfile, *, max_draft: int, verify_lens: tuple[int, ...],
                      cost_ratio: Callable[[int], float | None]) -> int:
    """Of the full drafts the verify graphs take (AR - 1) up to max_draft (BASS's length), the one with the most
    expected tokens per decode step's worth of time (on a 2-core CPU a multi-row step is compute-bound: AR=4
    costs ~1.7 decode steps, AR=16 ~5). A graph never timed yet is tried first, so every cost gets measured."""
    lengths = [ar - 1 for ar in verify_lens if ar - 1 <= max_draft] or [max_draft]
    best, best_rate = lengths[-1], -1.0
    for k in lengths:
        cost = cost_ratio(k + 1)
        if cost is None:
            return k
        rate = profile.expected_tokens(k) / cost
        if rate > best_rate:
            best, best_rate = k, rate
    return best


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

    A verify step costs more than a decode step (SmolLM2 on 2 CPU cores: AR=4 1.7x, AR=8 2.9x), so drafts
    that are rarely accepted (open chat with prompt lookup) would make decoding slower. The draft length is
    BASS's, cut to the verify graph with the most expected tokens per unit of measured cost (AcceptanceProfile);
    when even that does not pay, plain decoding runs and a probe every `probe_every` steps keeps the
    estimate fresh.
    """

    def __init__(self, drafter: Drafter, *, length: DraftLength | None = None, probe_every: int = 8) -> None:
        self.drafter = drafter
        self.length = length or DraftLength()
        self.stats = SpeculationStats()
        self.probe_every = probe_every
        self._num_skipped = 0
        self.profile = AcceptanceProfile()  # its prior (rate 1/2 everywhere) lets speculation be tried

    def _pays(self, engine, num_draft: int) -> bool:
        cost = engine.verify_cost_ratio(engine.verify_len(num_draft + 1))
        return cost is None or self.profile.expected_tokens(num_draft) > cost

    def step(self, gen: Generator, params: SamplingParams) -> list[int] | None:
        """One draft-and-verify step after gen's pending token; the new tokens, or None to decode plainly."""
        engine, last = gen.engine, gen.pending_token
        if last is None or not engine.verify_lens:
            return None
        context = gen.tokens + [last]
        max_draft = fit_to_verify_graphs(self.length.current, engine.verify_lens)
        if not self.length.fixed:
            max_draft = cost_aware_length(self.profile, max_draft=max_draft, verify_lens=engine.verify_lens,
                                          cost_ratio=engine.verify_cost_ratio)
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
        self.profile.record(len(draft), len(accepted))
        self.stats.num_steps += 1
        self.stats.num_drafted += len(draft)
        self.stats.num_accepted += len(accepted)
        return [*accepted, nxt]
