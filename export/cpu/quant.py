"""Block quantization for MatMulNBits, with a block-mean correction carried as extra K columns.

Why the correction: a GGUF Q4_1 source is already 4-bit, w = d q + m per block of 32 along K, with a
float minimum m. MatMulNBits keeps the same d and q but needs an integer zero point, so every block is
shifted by d (round(z) - z), z = -m/d: a constant error per block of up to half a step. On SmolLM2 that
block-constant part is nearly all of the requantization error, and it costs much of the top-1 agreement
with the float model.

A constant per block is cheap to undo: x . w_err = sum_b eps_b * S_b(x), S_b the sum of x over block b.
So the weight gets K/block extra rows holding eps (quantized like the rest, zero-padded to whole blocks)
and the input gets the matching extra columns S(x) = x @ ones-per-block: one tiny MatMul and one Concat
per linear input. With it, 4-bit SmolLM2 keeps most of the float model's top-1 choices (8-bit head; checked
by tests/test_cpu_target.py::test_smollm2_int4_top1_agrees_with_float_on_the_eval_text). For float (HF)
sources the same rows remove the block-mean part of the rounding error, which is small there but never
harmful.
"""
from __future__ import annotations

import numpy as np
from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

from staticlm.export.source_grid import block_indicator


def dequantize(packed: np.ndarray, scales: np.ndarray, *, zero_points: np.ndarray | None, bits: int,
               k: int) -> np.ndarray:
    """MatMulNBits' stored form -> W [N, k] (rows are output features).

    packed [N, K/block, block*bits/8] (low nibble first at 4 bits), scales [N, K/block],
    zero_points packed like the weights along the blocks (None: symmetric, 2^(bits-1)).
    """
    n, blocks = scales.reshape(packed.shape[0], -1).shape
    block = packed.shape[-1] * 8 // bits
    if bits == 4:
        q = np.stack([packed & 15, packed >> 4], -1).reshape(n, blocks * block)
    else:
        q = packed.reshape(n, blocks * block)
    if zero_points is None:
        zp = np.full((n, blocks), 1 << (bits - 1), np.float32)
    elif bits == 4:
        zp = np.stack([zero_points & 15, zero_points >> 4], -1).reshape(n, -1)[:, :blocks]
    else:
        zp = zero_points.reshape(n, blocks)
    w = (q.reshape(n, blocks, block).astype(np.float32) - zp[..., None]) * scales.reshape(n, blocks)[..., None]
    return w.reshape(n, blocks * block)[:, :k]


class BlockQuantizer:
    def __init__(self, *, bits: int, block_size: int, symmetric: bool, accuracy_level: int) -> None:
        self.bits, self.block = bits, block_size
        self.symmetric = symmetric
        self._q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
            block_size=block_size, is_symmetric=symmetric, bits=bits, accuracy_level=accuracy_level))

    def quantize(self, w_in_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """w [K, N] -> (packed, scales, zero points or None), by onnxruntime.quantization (never by hand)."""
        packed, scales, zp = self._q.qbits_block_quant(np.ascontiguousarray(w_in_out, np.float32))
        return packed, scales, None if self.symmetric else zp

    def corrected(self, w_in_out: np.ndarray) -> np.ndarray:
        """w [K, N] -> [K + correction_rows, N]: w, then one row per block holding its mean rounding error."""
        k, n = w_in_out.shape
        packed, scales, zp = self.quantize(w_in_out)
        err = w_in_out.T - dequantize(packed, scales, zero_points=zp, bits=self.bits, k=k)  # [N, K]
        eps = err.reshape(n, k // self.block, self.block).mean(-1)  # [N, K/block]
        rows = np.zeros((correction_rows(k, self.block), n), np.float32)  # zero-padded to whole blocks
        rows[:k // self.block] = eps.T
        return np.concatenate([w_in_out, rows])


def correction_rows(k: int, block: int) -> int:
    """K/block rounded up to whole blocks: an aligned K' keeps MatMulNBits on its full-block kernels
    (a partial last block makes every step slower)."""
    return -(-(k // block) // block) * block


def block_sum_matrix(k: int, block: int) -> np.ndarray:
    """[k, correction_rows] ones per block, zero padding: x @ it sums x over each block (the rows' input)."""
    sums = block_indicator(k, block)  # [k, k/block]
    return np.pad(sums, ((0, 0), (0, correction_rows(k, block) - k // block)))
