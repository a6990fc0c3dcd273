"""A GGUF tensor's own quantization grid, read from its type and raw blocks (never guessed from values).

Every type with an exact form is one of two shapes, per block of `block` inputs of an output row:

    symmetric types (Q4_0, Q5_0, Q8_0, Q6_K):   w = s (q - mid)
    types with minima (Q4_1, Q5_1, Q4_K, Q5_K): w = s q + mins

with q an unsigned level, s a float32 scale and mins a float32 offset per block. The arithmetic is ggml's
(gguf-py's quants module is the reference for the block layouts): the products s q are exact in float32,
and `dequantize` rounds once, as gguf does, so it equals gguf's own dequantization bit for bit.

Targets keep the levels and scales as they are (4-bit or 8-bit containers, blocks of 32 or 16) and carry
the minima as a per-block offset: w = s (q - z) + c with c = mins + z s. The zero point z of each block is
the type's mid level where that c is exact in float32, else 0 (c = mins), so `s (q - z) + c` also rounds
once to the same value: the exported weights stay bit-exact (tests/test_gguf_grids.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256  # a K-quant super-block
_F16 = np.float16


@dataclass(frozen=True)
class WeightGrid:
    qtype: str  # the GGUF type name, e.g. "Q4_K"
    block: int  # inputs per scale: 32, or 16 (Q6_K)
    levels: np.ndarray  # [N, K] uint8: q, in 0 .. 2^type_bits - 1
    scales: np.ndarray  # [N, K / block] float32: s
    mins: np.ndarray | None  # [N, K / block] float32, or None for a symmetric type
    mid: int  # the level that stands for 0 in a symmetric type (8, 16, 32 or 128)
    # [N, K / block] uint8: each block's own zero level, w = s (q - zeros) (a float source rounded by export/gptq
    # onto an asymmetric grid; no GGUF type has these); None: mid for every block
    zeros: np.ndarray | None = None
    # [N, row bytes] uint8: the GGUF tensor's own blocks, rows in this grid's order (a view of the mapped file
    # until rows are picked); None for a grid that is not a GGUF tensor's
    raw: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.levels.shape

    @property
    def bits(self) -> int:
        """The container: 4 bits when every level fits in a nibble, else 8."""
        return 4 if self.mid <= 8 else 8

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, in gguf's arithmetic (one rounding per weight)."""
        s = np.repeat(self.scales, self.block, axis=1)
        if self.zeros is not None:
            return s * (self.levels.astype(np.float32) - np.repeat(self.zeros, self.block, axis=1).astype(np.float32))
        if self.mins is None:
            return s * (self.levels.astype(np.float32) - np.float32(self.mid))
        return s * self.levels.astype(np.float32) + np.repeat(self.mins, self.block, axis=1)

    def zero_points(self) -> np.ndarray:
        """[N, K / block] uint8: mid, or 0 where mins + mid s would not be exact in float32."""
        if self.zeros is not None:
            return self.zeros
        z = np.full(self.scales.shape, self.mid, np.uint8)
        if self.mins is not None:
            exact = _offsets(self.mins, self.scales, self.mid).astype(np.float64) == \
                self.mins.astype(np.float64) + self.mid * self.scales.astype(np.float64)
            z[~exact] = 0
        return z

    def offsets(self) -> np.ndarray | None:
        """[N, K / block] float32 c = mins + z s (exact), or None for a symmetric type."""
        if self.mins is None:
            return None
        return (self.mins + self.zero_points().astype(np.float32) * self.scales).astype(np.float32)

    def rows(self, index) -> WeightGrid:
        """The grid of some output rows (a slice or an index array): a head, or llama.cpp's q/k row order undone."""
        return replace(self, levels=np.ascontiguousarray(self.levels[index]),
                       scales=np.ascontiguousarray(self.scales[index]),
                       mins=None if self.mins is None else np.ascontiguousarray(self.mins[index]),
                       zeros=None if self.zeros is None else np.ascontiguousarray(self.zeros[index]),
                       raw=None if self.raw is None else np.ascontiguousarray(self.raw[index]))


@dataclass(frozen=True)
class FloatWeight:
    """A GGUF float matrix (F32, F16, BF16): its float32 values are exact, so a target keeps them unrounded."""

    qtype: str
    values: np.ndarray  # [N, K] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    def dequantize(self) -> np.ndarray:
        return self.values

    def rows(self, index) -> FloatWeight:
        return FloatWeight(qtype=self.qtype, values=np.ascontiguousarray(self.values[index]))


def _offsets(mins: np.ndarray, scales: np.ndarray, mid: int) -> np.ndarray:
    return (mins + np.float32(mid) * scales).astype(np.float32)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] float32."""
    return np.ascontiguousarray(raw).view(_F16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int, span: int) -> np.ndarray:
    """ggml's nibble order: per `span` bytes, the low nibbles come first, then the high ones."""
    q = qs.reshape(n, -1, 1, span) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Q5_0/Q5_1: a little-endian uint32 of each level's 5th bit -> [n, 32] uint8."""
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit minima (gguf-py's Q4_K.get_scale_min)."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode(qtype: T, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[n, type_size] raw blocks -> levels [n, block_len] uint8, scales [n, subblocks], mins or None."""
    n = blocks.shape[0]
    if qtype == T.Q4_0:
        return _nibbles(blocks[:, 2:], n, 16), _f16(blocks[:, :2]), None
    if qtype == T.Q4_1:
        return _nibbles(blocks[:, 4:], n, 16), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if qtype == T.Q5_0:
        return _nibbles(blocks[:, 6:], n, 16) | (_high_bits(blocks[:, 2:6], n) << 4), _f16(blocks[:, :2]), None
    if qtype == T.Q5_1:
        q = _nibbles(blocks[:, 8:], n, 16) | (_high_bits(blocks[:, 4:8], n) << 4)
        return q, _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if qtype == T.Q8_0:
        return (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), _f16(blocks[:, :2]), None
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        if qtype == T.Q4_K:
            q = _nibbles(blocks[:, 16:], n, 32)
        else:
            qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = _nibbles(blocks[:, 48:], n, 32) | ((qh & np.uint8(1)).reshape(n, -1) << 4)
        return q, d * sc, -(dmin * mn)
    if qtype == T.Q6_K:
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc, d = blocks[:, 192:208].view(np.int8).astype(np.float32), _f16(blocks[:, 208:210])
        low = _nibbles(ql, n, 64).reshape(n, -1, 32)
        high = ((qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3)
        return (low | (high.reshape(n, -1, 32) << 4)).reshape(n, QK_K), d * sc, None
    raise ValueError(qtype)


# type -> (inputs per scale, mid level); the types a target keeps exactly
GRID_TYPES: dict[T, tuple[int, int]] = {
    T.Q4_0: (32, 8), T.Q4_1: (32, 8), T.Q5_0: (32, 16), T.Q5_1: (32, 16), T.Q8_0: (32, 128),
    T.Q4_K: (32, 8), T.Q5_K: (32, 16), T.Q6_K: (16, 32),
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def decode_grid(qtype: T, raw: np.ndarray, shape: tuple[int, int]) -> WeightGrid:
    """A GGUF tensor's raw bytes ([N, row bytes] uint8) of a GRID_TYPES type -> its WeightGrid [N, K]."""
    block, mid = GRID_TYPES[qtype]
    n, k = shape
    from gguf import GGML_QUANT_SIZES

    block_len, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * k // block_len, type_size)
    levels, scales, mins = _decode(qtype, blocks)
    return WeightGrid(qtype=qtype.name, block=block, levels=levels.reshape(n, k),
                      scales=scales.astype(np.float32).reshape(n, k // block),
                      mins=None if mins is None else mins.astype(np.float32).reshape(n, k // block), mid=mid,
                      raw=np.asarray(raw, dtype=np.uint8).reshape(n, -1))
