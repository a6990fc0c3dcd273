"""Mixed precision for a float source's rounded projections: which get 8-bit blocks under a bits budget.

Every projection is rounded at both widths (calibrated.py); its cost at each is the output error on the calibration
rows relative to its output's energy, trace(D^T H D) / trace(W^T H W), a number without units, so that a q and a
down projection compare. A unit (one projection, or a layer's gate and up together: HTP stacks them into one
weight, whose container is 8-bit as soon as one part is) moves to the high width in the order of the error it
removes per extra bit, largest first, while the average over every rounded weight stays within the budget
(llama.cpp's Q4_K_M gives some attn_v and ffn_down tensors 6 bits by a fixed rule; here the calibration rows rank).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class UnitCost:
    names: tuple[str, ...]  # the HF projections moved together
    num_weights: int
    low_error: float  # relative output error at the low width (summed over the unit's projections)
    high_error: float  # the same at the high width


def unit_key(hf_name: str) -> str:
    """The unit a projection belongs to: gate and up of one layer share one."""
    return hf_name.replace(".mlp.gate_proj.", ".mlp.gate_up.").replace(".mlp.up_proj.", ".mlp.gate_up.")


def choose_high(units: Iterable[UnitCost], *, budget: float, low_bits: int, high_bits: int) -> set[str]:
    """The projections that get high_bits so that the average level bits per weight is at most budget."""
    units = list(units)
    total = sum(u.num_weights for u in units)
    room = (budget - low_bits) * total  # extra level bits the budget allows
    extra = high_bits - low_bits
    ranked = sorted((u for u in units if u.low_error > u.high_error),
                    key=lambda u: (u.low_error - u.high_error) / (extra * u.num_weights), reverse=True)
    chosen: set[str] = set()
    for u in ranked:  # a unit that does not fit is passed over: a smaller one further down may
        if extra * u.num_weights <= room:
            room -= extra * u.num_weights
            chosen.update(u.names)
    return chosen


def mean_bits(num_weights: dict[str, int], high: set[str], *, low_bits: int, high_bits: int) -> float:
    """Average level bits per weight over the projections of num_weights."""
    total = sum(num_weights.values())
    return sum(n * (high_bits if name in high else low_bits) for name, n in num_weights.items()) / max(total, 1)
