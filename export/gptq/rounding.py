"""GPTQ on a block grid, in numpy: the grid (a scale and zero point per block of inputs of each output column) is
chosen first, then the rows are rounded onto it one at a time (Frantar et al., 2022, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers"; the grid fixed before the sweep is its "static groups").

Weights are [K, N] (inputs, outputs), the layout of the graphs' MatMul(x, W); a weight is w = s (q - z) with q an
integer level in [lo, hi]: lo = -2^(bits-1), z = 0 for a symmetric grid, lo = 0 and z in [0, 2^bits - 1] for an
asymmetric one (any real z with float_zero). One output column's scale over all K inputs is the block K (the HTP
target's per-channel 8 bits).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Of H's mean diagonal, added to it. The reference uses 0.01; on SmolLM2's recorded inputs 0.1 gave lower output
# error on held-out rows at every layer tried (per-channel 8 bits).
DAMP = 0.1
LAZY_ROWS = 128  # rows rounded together before their error reaches the rest (same result, fewer updates)
# Clipping ratios of the block's range tried for its scale: a block's outliers may cost the output less clipped
# than every other weight of the block coarsened to reach them.
CLIP_RATIOS = tuple(np.round(np.arange(1.0, 0.59, -0.025), 3))


@dataclass(frozen=True)
class Grid:
    bits: int
    block: int
    symmetric: bool
    # asymmetric only: each block's zero z any real number (a float offset -s z per block, as GGUF's Q4_1 minima),
    # not one of the levels
    float_zero: bool = False

    @property
    def lo(self) -> int:
        return -(1 << (self.bits - 1)) if self.symmetric else 0

    @property
    def hi(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    k, n = w.shape
    return w.reshape(k // block, block, n)  # [K/b, b, N]


def _candidate(wb: np.ndarray, grid: Grid, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """wb [K/b, b, N] -> scales, zeros [K/b, N] for the block's range shrunk by ratio."""
    lo_v, hi_v = np.minimum(wb.min(axis=1), 0.0), np.maximum(wb.max(axis=1), 0.0)
    if grid.symmetric:  # the finest scale whose levels lo..hi reach both ends (blocks.int4_block_scales)
        scales = np.maximum(lo_v / grid.lo, hi_v / grid.hi) * ratio
        zeros = np.zeros_like(scales)
    else:
        scales = (hi_v - lo_v) * ratio / (grid.hi - grid.lo)
        zeros = -lo_v * ratio / np.where(scales > 0, scales, 1.0)
        if not grid.float_zero:
            zeros = np.clip(np.round(zeros), grid.lo, grid.hi)
    return np.where(scales > 0, scales, 1.0).astype(np.float32), zeros.astype(np.float32)  # a zero block: any scale


def nearest(w: np.ndarray, *, scales: np.ndarray, zeros: np.ndarray, grid: Grid) -> np.ndarray:
    """[K, N] -> the levels q [K, N] (float32 integers) nearest to w on the grid."""
    s, z = np.repeat(scales, grid.block, axis=0), np.repeat(zeros, grid.block, axis=0)
    return np.clip(np.round(w / s + z), grid.lo, grid.hi)


def dequantize(q: np.ndarray, *, scales: np.ndarray, zeros: np.ndarray, block: int) -> np.ndarray:
    return (np.repeat(scales, block, axis=0) * (q - np.repeat(zeros, block, axis=0))).astype(np.float32)


def minmax_grid(w: np.ndarray, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """The scales and zeros from each block's range alone (round-to-nearest's usual choice)."""
    return _candidate(_blocks(w.astype(np.float32), grid.block), grid, 1.0)


def searched_grid(w: np.ndarray, diag_h: np.ndarray, grid: Grid,
                  ratios: tuple[float, ...] = CLIP_RATIOS) -> tuple[np.ndarray, np.ndarray]:
    """Scales and zeros [K/b, N] minimizing each block's output error under nearest rounding, the squared error
    of each input weighted by its energy diag(H) = sum of x_k^2 over the calibration rows."""
    wb = _blocks(w.astype(np.float32), grid.block)
    d = _blocks(np.asarray(diag_h, np.float32)[:, None], grid.block)  # [K/b, b, 1]
    best = best_s = best_z = None
    for ratio in ratios:
        s, z = _candidate(wb, grid, ratio)
        q = np.clip(np.round(wb / s[:, None] + z[:, None]), grid.lo, grid.hi)
        err = (d * (wb - s[:, None] * (q - z[:, None])) ** 2).sum(axis=1)  # [K/b, N]
        if best is None:
            best, best_s, best_z = err, s, z
        else:
            better = err < best
            best, best_s, best_z = (np.where(better, a, b) for a, b in ((err, best), (s, best_s), (z, best_z)))
    return best_s, best_z


def gptq(w: np.ndarray, h: np.ndarray, *, scales: np.ndarray, zeros: np.ndarray, grid: Grid, act_order: bool = True,
         damp: float = DAMP) -> np.ndarray:
    """w [K, N] float, h [K, K] = X^T X of the layer's inputs -> the levels q [K, N] (float32 integers) on the
    grid (scales, zeros [K/block, N], fixed: each row keeps its block's, whatever order it is rounded in).

    act_order rounds rows in the order of their input's energy (diag H, largest first): the rows whose error costs
    most are rounded while every other row can still absorb it."""
    k = w.shape[0]
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(k)
    s, z = np.repeat(scales, grid.block, axis=0)[order], np.repeat(zeros, grid.block, axis=0)[order]  # [K, N]
    q = sweep(w[order], h[np.ix_(order, order)], s=s, z=z, lo=grid.lo, hi=grid.hi, damp=damp)
    return q[np.argsort(order)]


def sweep(w: np.ndarray, h: np.ndarray, *, s: np.ndarray, z: np.ndarray, lo: int, hi: int,
           damp: float) -> np.ndarray:
    """Rows in the order given, each rounded to nearest on its own scales s and zeros z [K, N], its error moved
    onto the rows after it through the upper Cholesky factor of H^-1."""
    w = w.astype(np.float32)  # a copy: the rows not yet rounded absorb the error
    h = h.astype(np.float64)  # a copy; inverted in float64, applied in float32
    dead = np.diag(h) == 0  # inputs that were always zero: any value works, zero is exact
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T.astype(np.float32)  # upper Cholesky factor of H^-1
    s, z = s.astype(np.float32), z.astype(np.float32)
    q = np.zeros_like(w)
    for i1 in range(0, w.shape[0], LAZY_ROWS):
        i2 = min(i1 + LAZY_ROWS, w.shape[0])
        block, errors = w[i1:i2].copy(), np.zeros((i2 - i1, w.shape[1]), np.float32)
        hb = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            r = i1 + i
            q[r] = np.clip(np.round(block[i] / s[r] + z[r]), lo, hi)
            err = (block[i] - s[r] * (q[r] - z[r])) / hb[i, i]
            block[i:] -= np.outer(hb[i, i:], err)
            errors[i] = err
        w[i2:] -= hinv[i1:i2, i2:].T @ errors
    return q


def output_error(delta: np.ndarray, h: np.ndarray) -> float:
    """sum over calibration rows of |x delta|^2 = trace(delta^T H delta), delta [K, N]."""
    d = delta.astype(np.float64)
    return float(np.einsum("kn,kn->", h.astype(np.float64) @ d, d))
