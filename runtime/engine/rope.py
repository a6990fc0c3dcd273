"""RoPE cos/sin of any position from two small tables, on the host and in a `--target cpu` graph alike.

Position p = hi S + lo (S: a power of two near sqrt(max_positions)), and per rotated pair i
  cos(p θ_i) = cos(hi S θ_i) cos(lo θ_i) - sin(hi S θ_i) sin(lo θ_i)
  sin(p θ_i) = sin(hi S θ_i) cos(lo θ_i) + cos(hi S θ_i) sin(lo θ_i)
four float32 products and one sum or difference each. The tables hold about 2 sqrt(max_positions) rows where one
row per position would cost a model's long context times its head width, per base and function (Gemma 3's two
bases over 32K positions at 256 head dims were a quarter of its weights). The host's rows (`RopeTable.fill`, for the
graphs that take rope_cos/rope_sin as inputs) and a graph's own (export/cpu/rope.py) are the same operations on the
same tables, so a position's cos/sin have the same bits wherever they are computed: a row attended in a segmented
graph sees what it sees on the lane.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from staticlm.runtime.family.config import ModelConfig


@dataclass(frozen=True)
class SplitRope:
    """The two tables of one RoPE base. hi rows carry longrope's attention factor (it scales the rotated dims)."""

    step: int  # S
    cos_hi: np.ndarray  # [ceil(max_positions / S), R/2] float32: cos(hi S θ) x factor
    sin_hi: np.ndarray  # [ceil(max_positions / S), R/2] float32: sin(hi S θ) x factor
    cos_lo: np.ndarray  # [S, R/2] float32: cos(lo θ)
    sin_lo: np.ndarray  # [S, R/2] float32: sin(lo θ)

    def tables(self) -> dict[str, np.ndarray]:
        return {"cos_hi": self.cos_hi, "sin_hi": self.sin_hi, "cos_lo": self.cos_lo, "sin_lo": self.sin_lo}

    def half_cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions [...] (0 .. max_positions - 1) -> cos, sin [..., R/2] float32."""
        hi, lo = np.divmod(positions, self.step)
        ch, sh, cl, sl = self.cos_hi[hi], self.sin_hi[hi], self.cos_lo[lo], self.sin_lo[lo]
        return ch * cl - sh * sl, sh * cl + ch * sl


def rope_step(max_positions: int) -> int:
    """S: the power of two nearest sqrt(max_positions) from above, which makes the two tables about equal."""
    return 1 << math.ceil(math.log2(max(max_positions, 2)) / 2)


def split_rope(config: ModelConfig, *, local: bool = False) -> SplitRope:
    """local: the local layers' RoPE (config.local_inv_freq, no attention factor)."""
    inv_freq = config.local_inv_freq() if local else config.inv_freq()  # [R/2] float64
    factor = 1.0 if local else config.rope_attention_factor
    step = rope_step(config.max_positions)
    hi = np.outer(np.arange(-(-config.max_positions // step), dtype=np.float64) * step, inv_freq)  # [rows, R/2]
    lo = np.outer(np.arange(step, dtype=np.float64), inv_freq)  # [S, R/2]
    f32 = np.float32
    return SplitRope(step=step, cos_hi=(np.cos(hi) * factor).astype(f32), sin_hi=(np.sin(hi) * factor).astype(f32),
                     cos_lo=np.cos(lo).astype(f32), sin_lo=np.sin(lo).astype(f32))


class RopeTable:
    """The host's RoPE rows for graphs that take them as inputs (HF's rotate_half layout over the first rope_dims
    dims; the dims past them, a partial rotary, pass through: cos 1, sin 0), computed per step for the step's
    positions."""

    def __init__(self, config: ModelConfig, *, local: bool = False) -> None:
        self.max_positions = config.max_positions
        self._rope = split_rope(config, local=local)
        self._half = config.rope_dims // 2

    def fill(self, positions: np.ndarray, *, cos_out: np.ndarray, sin_out: np.ndarray) -> None:
        """positions [B, AR] -> cos_out/sin_out [B, 1, AR, D], written in place."""
        pos = np.minimum(positions, self.max_positions - 1)  # padded rows may run past the end; never read
        cos, sin = self._rope.half_cos_sin(pos)  # [B, AR, R/2]
        h = self._half
        for out, half, rest in ((cos_out, cos, 1.0), (sin_out, sin, 0.0)):
            out[:, 0, :, :h] = half
            out[:, 0, :, h:2 * h] = half
            out[:, 0, :, 2 * h:] = rest
