"""Where a request runs and whether its rows pair: the loop's placement rules, pure (no engine, no model).

A family's facts (`FamilyFacts`, read once from its manifest and the run options) decide:
- which batch rows there are (`rows_kind`): copies of the prompt in batch rows, rows that read one shared prompt
  segment (segments), or none (every sequence on the lane);
- whether a step may run a row alone is the engine's (Engine.pairs_rows, a fact here): a family whose ops compute
  every row alone (staticlm's attention and GGUF kernels, Manifest.rows_alone) may; elsewhere ORT's one-row
  kernels round otherwise than its several-row ones, so a lone row runs beside the row before it;
- whether a greedy row gets the lane's bits in the rows (`greedy_exact`): copies always do (the same graphs at
  any batch), and segments where the family attends with staticlm's own ops (Manifest.exact_attention) or rows do
  not pair; else the segmented graphs sum attention in another order than the lane;
- where a request runs (`place`): a greedy request on rows that would not give it the lane's bits runs on the lane;
- whether a batch step pairs its rows (`pairs_batch_step`): only for a greedy row, which an argmax near-tie would
  flip (a sampled draw only moves by as much).

tests/test_placement.py checks these rules property by property, and that greedy answers equal single runs for
generated mixes of requests.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

COPIES, SEGMENTS = "copies", "segments"


class Where(str, Enum):
    LANE = "lane"  # the one-sequence engine: the request's choices mirror one sequence (n greedy choices are one)
    ROWS = "rows"  # the batch rows, beside other requests


@dataclass(frozen=True)
class FamilyFacts:
    """What placement reads of a family and the run options."""

    num_copy_rows: int  # batch size of the batched decode graphs (1: none)
    num_segment_rows: int  # batch size of the segmented graphs (1: none)
    can_segment: bool  # the segmented graphs can run here (has_segments)
    exact_attention: bool  # Manifest.exact_attention: staticlm's attention ops on every path
    pairs_rows: bool  # Engine.pairs_rows: no row runs alone in a step
    shared_prompt_kv: bool = False  # --shared-prompt-kv: a cpu family's rows read one prompt segment


def rows_kind(facts: FamilyFacts, *, forced: str | None = None) -> str | None:
    """copies, segments or None (no rows); forced: one kind, to compare them (a benchmark)."""
    segments = facts.num_segment_rows > 1 and facts.can_segment
    if segments and (forced == SEGMENTS if forced is not None else
                     facts.num_copy_rows == 1 or facts.shared_prompt_kv):
        return SEGMENTS
    return COPIES if facts.num_copy_rows > 1 else None


def num_rows(facts: FamilyFacts, kind: str | None) -> int:
    return facts.num_segment_rows if kind == SEGMENTS else facts.num_copy_rows


def greedy_exact(facts: FamilyFacts, kind: str | None) -> bool:
    """Whether a greedy row gets in the rows of this kind the bits the lane would give it."""
    return kind != SEGMENTS or facts.exact_attention or not facts.pairs_rows


def place(facts: FamilyFacts, kind: str | None, *, greedy: bool) -> Where:
    """Where a request's choices decode, when rows are free for them."""
    if kind is not None and greedy and not greedy_exact(facts, kind):
        return Where.LANE
    return Where.ROWS


def pairs_batch_step(greedy_rows: Iterable[bool]) -> bool:
    """Whether a batch step asks the engine to run its rows beside their previous tokens (which it does where it
    pairs rows, Engine.pairs_rows; a speculator drafts into those rows instead): some row is greedy."""
    return any(greedy_rows)
