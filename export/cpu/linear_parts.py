"""The CPU target's linear nodes' weights, one writer per container, each told what to write (linears.py decides).

- GgufMatMul (runtime/kernels): a GGUF tensor's own blocks, as the file has them or grouped by rows;
- MatMulNBits over a source grid: its levels, scales and zero points exactly (the minima as offsets, linears.py), or
  with the minima folded into integer zero points and correction rows;
- MatMulNBits over a float weight rounded by quant.py's BlockQuantizer;
- a float matrix kept as it is (FLOAT_BITS).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from staticlm.export.sources.gguf_grids import FloatWeight, WeightGrid
from staticlm.runtime.kernels import ROW_GROUP
from staticlm.runtime.kernels import TYPES as KERNEL_TYPES

from .quant import BlockQuantizer, correction_rows

FLOAT_BITS = 32
# a Q4_K group block's level bytes (gguf_dot.h): slot i of half h holds row K4_SLOTS[h, i], so that one vector of
# 32 bytes is 8 levels of 4 rows and the sums of a half come back in row order through one hadd
K4_SLOTS = np.array([[0, 1, 4, 5], [2, 3, 6, 7]])


@dataclass(frozen=True)
class MatMulPart:
    """One MatMulNBits node: weights `{weight}.q`, `.scales` and (when zero_points) `.zp`; or, bits == FLOAT_BITS,
    a GGUF float matrix kept as it is: `{weight}.w` [N, K] float32, one FusedMatMul with transB."""

    weight: str
    n: int  # output columns
    bits: int
    block: int
    zero_points: bool
    corrected: bool  # a float weight with the block-mean correction rows (K' = K + correction_rows)
    symmetric: bool  # a float weight rounded symmetrically (no .zp)
    ggml_type: int | None = None  # GgufMatMul over `{weight}.gguf` [N, row bytes], the source's own blocks
    row_group: int = 0  # those blocks stored by groups of rows (group_rows), or 0: in the file's order
    node_rows: tuple[int, ...] = ()  # MatMulNBits: the rows of each node it runs as (linears.node_rows); (): one


def pack_levels(levels: np.ndarray, *, bits: int, block: int) -> np.ndarray:
    """[N, K] uint8 levels -> MatMulNBits' B [N, K/block, block bits/8] (4 bits: low nibble first)."""
    n, k = levels.shape
    if bits == 8:
        return np.ascontiguousarray(levels.reshape(n, k // block, block))
    pairs = levels.reshape(n, k // block, block // 2, 2)
    return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4))


def pack_zero_points(zp: np.ndarray, *, bits: int) -> np.ndarray:
    """[N, K/block] uint8 -> MatMulNBits' zero_points ([N, ceil(K/block / 2)] at 4 bits, low nibble first)."""
    if bits == 8:
        return np.ascontiguousarray(zp)
    n, blocks = zp.shape
    padded = np.zeros((n, blocks + blocks % 2), np.uint8)
    padded[:, :blocks] = zp
    return np.ascontiguousarray(padded[:, 0::2] | (padded[:, 1::2] << 4))


def write_block_part(writer, weight: str, grid: WeightGrid, *, row_group: int) -> MatMulPart:
    """A GGUF tensor's own blocks [N, row bytes] (rows in HF order): as the file has them (row_group 0), or grouped
    by row_group (ROW_GROUP) rows for a type the kernels dot a group at a time."""
    n = grid.shape[0]
    blocks = group_rows(grid.raw, qtype=grid.qtype) if row_group else np.ascontiguousarray(grid.raw)
    writer.add(f"{weight}.gguf", blocks)
    return MatMulPart(weight=weight, n=n, bits=grid.bits, block=grid.block, zero_points=False, corrected=False,
                      symmetric=False, ggml_type=KERNEL_TYPES[grid.qtype], row_group=row_group)


def group_rows(raw: np.ndarray, *, qtype: str) -> np.ndarray:
    """[N, row bytes] -> the same bytes by groups of ROW_GROUP rows, so a group's 8 rows are read as one stream:
    the kernels' C structs in runtime/kernels/gguf_dot.h name each layout written here. Block b of a group's row j
    at (b ROW_GROUP + j) blocks from the group's start (block_q4_0x8 and its kin); for Q4_K and Q6_K, those 8 blocks
    rearranged as one group block whose levels need no shuffle (block_q4_Kx8, block_q6_Kx8, field by field below).
    Every byte is kept: only moved."""
    n, row_bytes = raw.shape
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    num_groups, num_blocks = n // ROW_GROUP, row_bytes // block_bytes
    blocks = raw.reshape(num_groups, ROW_GROUP, num_blocks, block_bytes).transpose(0, 2, 1, 3)  # [G, nb, 8, bytes]
    shape = (num_groups, num_blocks, ROW_GROUP)
    if qtype == "Q4_K":
        d, dmin = blocks[..., 0:2], blocks[..., 2:4]  # [G, nb, 8, 2] float16 bytes: d, dmin
        words = blocks[..., 4:16].reshape(*shape, 3, 4).swapaxes(2, 3)  # [G, nb, 3, 8, 4]: scale_words
        qs = blocks[..., 16:].reshape(*shape, 4, 4, 8)  # [G, nb, row, chunk, eighth, 8] -> qs[chunk][eighth]
        parts = (d, dmin, words, slotted(qs))
    elif qtype == "Q6_K":
        scales = blocks[..., 192:208].swapaxes(2, 3)  # [G, nb, 16, 8]: scales[s][row], after d[row]
        ql = blocks[..., :128].reshape(*shape, 2, 2, 4, 8)  # [G, nb, row, half, 32 bytes of 64, eighth, 8]
        qh = blocks[..., 128:192].reshape(*shape, 2, 1, 4, 8)
        parts = (blocks[..., 208:210], scales, slotted(np.concatenate([ql, qh], axis=4)))
    else:
        return np.ascontiguousarray(blocks).reshape(n, row_bytes)
    return np.concatenate([p.reshape(num_groups, num_blocks, -1) for p in parts], axis=2).reshape(n, row_bytes)


def slotted(levels: np.ndarray) -> np.ndarray:
    """[G, nb, row, ..., eighth, 8] level bytes -> [G, nb, ..., eighth, half, slot, 8]: 32 bytes of 4 rows at a time
    (EighthOf8Rows in gguf_dot.h), row K4_SLOTS[half, slot]."""
    by_slot = levels[:, :, K4_SLOTS]  # [G, nb, half, slot, ..., eighth, 8]
    order = list(range(by_slot.ndim))
    return by_slot.transpose(0, 1, *order[4:-1], 2, 3, order[-1])


def write_grid_part(writer, weight: str, grid: WeightGrid | FloatWeight) -> MatMulPart:
    """A source grid's levels, scales and zero points (or a float matrix's values), exactly; returns its node."""
    n, k = grid.shape
    if isinstance(grid, FloatWeight):
        writer.add(f"{weight}.w", grid.values.astype(np.float32))  # [N, K]
        return MatMulPart(weight=weight, n=n, bits=FLOAT_BITS, block=k, zero_points=False, corrected=False,
                          symmetric=False)
    writer.add(f"{weight}.q", pack_levels(grid.levels, bits=grid.bits, block=grid.block))
    writer.add(f"{weight}.scales", grid.scales)  # [N, K/block]
    writer.add(f"{weight}.zp", pack_zero_points(grid.zero_points(), bits=grid.bits))
    return MatMulPart(weight=weight, n=n, bits=grid.bits, block=grid.block, zero_points=True, corrected=False,
                      symmetric=False)


def write_folded_grid_part(writer, weight: str, grid: WeightGrid, quant: BlockQuantizer) -> MatMulPart:
    """A grid with minima as MatMulNBits over [x, S(x)] (GridMinima.FOLDED): its own levels and scales, the
    nearest integer zero point z' per block, and the remainder eps = c + s (z' - z0) per block (under half a
    step) in correction rows that `quant` (quant.BlockQuantizer at the grid's bits) rounds: w = s (q - z') + eps."""
    n, k = grid.shape
    z0, c, s = grid.zero_points().astype(np.float32), grid.offsets(), grid.scales  # [N, K/32] each
    safe = np.where(s > 0, s, 1.0)
    z = np.clip(np.rint(z0 - c / safe), 0, (1 << grid.bits) - 1).astype(np.uint8)
    z = np.where(s > 0, z, z0.astype(np.uint8))
    eps = c + s * (z.astype(np.float32) - z0)  # [N, K/32]
    rows = np.zeros((correction_rows(k, grid.block), n), np.float32)  # [R, N], zero-padded to whole blocks
    rows[:k // grid.block] = eps.T
    packed, scales, zp = quant.quantize(rows)  # [N, R/32, blob], [N, R/32], packed zero points
    num_blocks = rows.shape[0] // grid.block
    zp_values = (np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :num_blocks] if grid.bits == 4
                 else zp.reshape(n, num_blocks))
    writer.add(f"{weight}.q", np.concatenate([pack_levels(grid.levels, bits=grid.bits, block=grid.block),
                                              packed.reshape(n, num_blocks, -1)], axis=1))
    writer.add(f"{weight}.scales", np.concatenate([s, scales.reshape(n, num_blocks)], axis=1).astype(np.float32))
    writer.add(f"{weight}.zp", pack_zero_points(np.concatenate([z, zp_values], axis=1), bits=grid.bits))
    return MatMulPart(weight=weight, n=n, bits=grid.bits, block=grid.block, zero_points=True, corrected=True,
                      symmetric=False)


def write_float_part(writer, weight: str, w: np.ndarray, quant: BlockQuantizer, *, corrected: bool) -> MatMulPart:
    """A float weight w [K, N], rounded by quant (onnxruntime.quantization), with the block-mean correction rows when
    corrected."""
    if corrected:
        w = quant.corrected(w)  # [K + correction_rows, N]
    packed, scales, zero_points = quant.quantize(w)
    writer.add(f"{weight}.q", packed)
    writer.add(f"{weight}.scales", scales)
    if zero_points is not None:
        writer.add(f"{weight}.zp", zero_points)
    return MatMulPart(weight=weight, n=w.shape[1], bits=quant.bits, block=quant.block,
                     zero_points=zero_points is not None, corrected=corrected, symmetric=quant.symmetric)
