"""The source's own 4-bit grid, kept exactly in the quantized HTP family.

A GGUF Q4_1 tensor stores each block of 32 inputs of an output row as w = d q + m (q in 0..15, one d and m per
block). Rounding those weights again onto a per-channel 8-bit grid moves almost all of them (SmolLM2 w8a16
loses top-1 agreement with float to the weights alone). They are exact on a symmetric block grid plus one
offset per block (tests/test_source_grid.py::test_q4_1_weights_decompose_exactly):

    w = d (q - 8) + c,  c = m + 8 d     so     x W = x Wq + (x E) C

with Wq in [-8, 7] times d (a blockwise int4 or int8 DequantizeLinear, which QNN HTP runs), E [K, K/32] the 0/1
block indicator (x E sums each block of x) and C [K/32, N] the offsets, a MatMul 1/32 the size of W.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # GGUF's block length along the input axis (Q4_0, Q4_1, Q8_0)
NUM_LEVELS = 16
MID_LEVEL = 8
LOWEST_LEVEL = -MID_LEVEL  # every Q4_1 block holds its minimum at level 0: d = (that value) / -8 exactly


def offsets_name(weight: str) -> str:
    """The weight file's name for C, the per-block offsets of `weight`."""
    return f"{weight}.block_offsets"


def block_sum_name(k: int) -> str:
    """The weight file's name for E, the [k, k / BLOCK] block indicator."""
    return f"block_sum_{k}"


@dataclass(frozen=True)
class BlockGrid:
    levels: np.ndarray  # [K, N] int8 in [-8, 7]
    scales: np.ndarray  # [K / BLOCK, N] float32: d, one per block of an output column
    offsets: np.ndarray  # [K / BLOCK, N] float32: c = m + 8 d

    def symmetric_part(self) -> np.ndarray:
        """[K, N] float32: d (q - 8), each value an exact multiple of its block's scale."""
        return (self.levels.reshape(-1, BLOCK, self.levels.shape[1]) * self.scales[:, None, :]).reshape(
            self.levels.shape).astype(np.float32)


def block_grid(w: np.ndarray) -> BlockGrid | None:
    """w [K, N] float32 -> its 4-bit block grid, or None when w is not exactly on one (a float source)."""
    k, n = w.shape
    if k % BLOCK:
        return None
    blocks = w.reshape(k // BLOCK, BLOCK, n).astype(np.float64)  # [K/32, 32, N]
    low, high = blocks.min(axis=1), blocks.max(axis=1)
    d = (high - low) / (NUM_LEVELS - 1)  # a block's min and max are its levels 0 and 15 (ggml's Q4_1 rounding)
    safe = np.where(d > 0, d, 1.0)
    q = np.rint((blocks - low[:, None]) / safe[:, None])
    # The decomposition must be exact in float32 (the graph's arithmetic), not only close
    scales = d.astype(np.float32)
    offsets = (low + MID_LEVEL * d).astype(np.float32)
    levels = (q - MID_LEVEL).astype(np.int8)
    grid = BlockGrid(levels=levels.reshape(k, n), scales=scales, offsets=offsets)
    rebuilt = grid.symmetric_part().reshape(blocks.shape) + offsets[:, None, :]
    tolerance = 1e-6 * np.abs(blocks).max(axis=1, keepdims=True) + 1e-30
    if not np.all(np.abs(rebuilt - blocks) <= tolerance):
        return None
    return grid


def block_indicator(k: int, block: int = BLOCK) -> np.ndarray:
    """[k, k / block] float32: x E sums each block of x."""
    return np.kron(np.eye(k // block, dtype=np.float32), np.ones((block, 1), np.float32))
