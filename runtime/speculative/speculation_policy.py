"""Whether speculation pays, and how long a draft should be: one model for one sequence and for a batch.

A verify step costs more than a decode step (Engine.verify_cost_ratio measures by how much), so drafts that are
rarely accepted make decoding slower. The draft length is BASS's (DraftLength), cut to the verify graph with
the most expected tokens per unit of measured cost (AcceptanceProfile, cost_aware_length); when even that does
not pay, plain decoding runs and a probe every `probe_every` skipped steps keeps the estimate fresh.
Speculator (speculative.py) and BatchSpeculator (batch_speculative.py) both decide with SpeculationPolicy.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from staticlm.runtime.engine.engine import Engine


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


def fit_to_verify_graphs(num_draft: int, verify_lens: tuple[int, ...]) -> int:
    """A draft length mapped onto the exported verify graphs: the longest that fills one exactly (a few
    more tokens would pay for the next graph's padding rows too); below the smallest graph, itself."""
    fitting = [ar - 1 for ar in verify_lens if ar - 1 <= num_draft]
    return max(fitting) if fitting else num_draft


@dataclass
class AcceptanceProfile:
    """How often draft position i was offered (every earlier one accepted) and accepted, over past steps.

    Prompt-lookup drafts are right for a run of tokens or wrong from the start, which one acceptance rate
    (a geometric model) undervalues for long drafts and overvalues for short ones. The product of the
    per-position rates (Laplace-smoothed) gives the expected accepted length of a k-token draft instead.
    """
    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    decay: float = 0.9  # per step: the last ~10 steps count, so a change of task (rewrite -> chat) shows soon

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's verify step."""
        self.record_step(num_drafted, (num_accepted,))

    def record_step(self, num_rows: int, num_accepted: Sequence[int]) -> None:
        """One verify step in which every sequence was offered num_rows draft rows and accepted its own count.

        The counts decay once per step, not once per sequence, so a batch forgets at the same pace as one sequence.
        """
        for counts in (self.offered, self.accepted):
            for i in range(len(counts)):
                counts[i] *= self.decay
            counts.extend([0.0] * (num_rows - len(counts)))
        for n in num_accepted:
            for i in range(min(n + 1, num_rows)):
                self.offered[i] += 1
            for i in range(n):
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
    expected tokens per decode step's worth of time (where a multi-row step is compute-bound, as on a CPU, longer
    graphs cost proportionally more). A graph never timed yet is tried first, so every cost gets measured."""
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


class SpeculationPolicy:
    """How many drafts to ask for, whether to verify them this step, and what each verify step taught.

    The profile starts from its prior (rate 1/2 at every position), so speculation gets tried before anything
    was measured.
    """

    def __init__(self, *, length: DraftLength | None = None, probe_every: int = 8) -> None:
        self.length = length or DraftLength()
        self.profile = AcceptanceProfile()
        self.probe_every = probe_every
        self.num_skipped = 0  # verify steps that did not pay and were not run

    def draft_length(self, engine: Engine) -> int:
        """Draft tokens to ask for: BASS's length on engine's verify graphs (unless fixed: the best per cost)."""
        max_draft = fit_to_verify_graphs(self.length.current, engine.verify_lens)
        if self.length.fixed:
            return max_draft
        return cost_aware_length(self.profile, max_draft=max_draft, verify_lens=engine.verify_lens,
                                 cost_ratio=engine.verify_cost_ratio)

    def should_verify(self, engine: Engine, num_draft: int) -> bool:
        """Verify num_draft drafts (per sequence) now? Yes while the cost is unmeasured or the expected tokens
        beat it; otherwise only every probe_every-th such step, so the profile can learn that drafts got better."""
        cost = engine.verify_cost_ratio(engine.verify_len(num_draft + 1))
        if cost is None or self.profile.expected_tokens(num_draft) > cost:
            return True
        self.num_skipped += 1
        return self.num_skipped % self.probe_every == 0

    def record(self, num_drafted: Sequence[int], num_accepted: Sequence[int]) -> None:
        """One verify step's outcome, per sequence: draft tokens it fed, and how many of them were accepted.

        In a batch every sequence is fed as many rows as the longest draft, its own draft then padding. The profile
        gets every sequence's outcome over those rows (padding rows offered, never accepted), not the batch's best:
        should_verify weighs the tokens a verify step yields per sequence against a decode step, which yields one
        per sequence, so the batch's mean is the figure that decides; its best would make every step look paying.
        The length follows BASS on the batch's best, as the paper does: it grows when some sequence accepted its
        whole draft (num_drafted > 0), and otherwise shrinks towards the most any sequence accepted.
        """
        num_rows = max(num_drafted)
        self.profile.record_step(num_rows, num_accepted)
        full = [d for d, a in zip(num_drafted, num_accepted, strict=True) if d and a == d]
        self.length.update(max(num_accepted), max(full) if full else num_rows)


__all__ = ["AcceptanceProfile", "DraftLength", "SpeculationPolicy", "cost_aware_length", "fit_to_verify_graphs"]
