"""How a float source's 4-bit projections are rounded when calibration traces are recorded (calibrated.py)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from staticlm.errors import InvalidOption

from .rounding import DAMP


class Rounding(str, Enum):
    NEAREST = "nearest"  # each block's scale by output error, every weight to its nearest level
    GPTQ = "gptq"  # rows in their stored order
    ACT_ORDER = "act-order"  # rows loudest input first
    SEQUENTIAL = "sequential"  # act-order, each layer's Hessians from the inputs the rounded layers before it give


@dataclass(frozen=True)
class GptqOptions:
    rounding: Rounding = Rounding.ACT_ORDER
    bits: int = 4
    block: int = 32
    # the grid: symmetric (zero offset), or asymmetric with per-block zero points (levels: MatMulNBits' zero
    # points), or with offsets, a float minimum per block (GGUF Q4_1's form: both targets add one small MatMul of
    # x's block sums, source_grid.py)
    symmetric: bool = True
    offsets: bool = False
    damp: float = DAMP
    sampled_tokens: int = 256  # per calibration prompt, the float model's own sampled answer (sampled.py); 0: none
    # mixed precision (recipe.py): the projections whose rounding costs most get high_bits blocks, as long as the
    # rounded projections average at most this many level bits per weight; None: every one at `bits`. On by default:
    # it beat plain 4-bit GPTQ on SmolLM2 as a float source (README, 4-bit weights from a float source)
    bits_budget: float | None = 4.5
    high_bits: int = 8

    def __post_init__(self) -> None:
        if self.bits_budget is not None and not self.bits <= self.bits_budget <= self.high_bits:
            raise InvalidOption(f"--bits-budget must lie between {self.bits} and {self.high_bits} bits per weight, "
                                f"got {self.bits_budget:g}")

    def to_dict(self) -> dict:
        return {"rounding": self.rounding.value, "bits": self.bits, "block": self.block,
                "symmetric": self.symmetric, "offsets": self.offsets, "damp": self.damp,
                "sampled_tokens": self.sampled_tokens,
                **({"bits_budget": self.bits_budget, "high_bits": self.high_bits} if self.bits_budget else {})}

