"""Speculative decoding on static graphs: drafts verified in the AR=N graph's otherwise padded rows.

A step feeds the last sampled token plus up to N-1 draft tokens to the smallest verify graph that
holds them. The model writes their K/V into the slot rows right after the window; `commit(m)`
keeps the accepted ones and rejected rows are overwritten by the next step, never copied.
Acceptance follows speculative sampling (Leviathan et al.): accept a draft token x with
probability min(1, p(x)/q(x)); on rejection, draw from the normalised positive part of p - q.
With greedy sampling p is one-hot, so this is exact-match and the output equals plain greedy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from staticlm.runtime.generate.sampling import SamplingParams, distribution
from staticlm.runtime.speculative.speculation_policy import DraftLength, SpeculationPolicy

if TYPE_CHECKING:
    from staticlm.runtime.generate.generator import Generator


class Drafter(Protocol):
    def propose(self, context: list[int], num_tokens: int, *, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        """Up to num_tokens draft tokens after context, and their proposal distributions q (None: point masses)."""


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
    """Drafts, verifies, accepts; and only speculates while it pays (SpeculationPolicy decides)."""

    def __init__(self, drafter: Drafter, *, length: DraftLength | None = None, probe_every: int = 8) -> None:
        self.drafter = drafter
        self.policy = SpeculationPolicy(length=length, probe_every=probe_every)
        self.stats = SpeculationStats()

    def step(self, gen: Generator, params: SamplingParams) -> list[int] | None:
        """One draft-and-verify step after gen's pending token; the new tokens, or None to decode plainly."""
        engine, last = gen.engine, gen.pending_token
        if last is None or not engine.verify_lens:
            return None
        context = gen.tokens + [last]
        draft, proposals = self.drafter.propose(context, self.policy.draft_length(engine), params=params,
                                                rng=gen.rng)
        while draft and engine.verify_len(len(draft) + 1) is None:
            draft = draft[:-1]  # near the end of the ladder a shorter verify graph may still fit
        if not draft or not self.policy.should_verify(engine, len(draft)):
            return None
        logits = engine.verify([last, *draft])  # [n, V]: row i predicts the token after input i
        accepted, nxt = accept_draft(logits, draft, proposals, params=params, context=context, rng=gen.rng)
        engine.commit(1 + len(accepted))
        gen.commit_speculated(last, accepted, nxt)
        self.policy.record((len(draft),), (len(accepted),))
        self.stats.num_steps += 1
        self.stats.num_drafted += len(draft)
        self.stats.num_accepted += len(accepted)
        return [*accepted, nxt]
