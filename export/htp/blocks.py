"""Blockwise (32 inputs) weights in a quantized graph: a Q4_1 source's own grid (source_grid.py), kept exactly,
and the 4-bit weights of a float source.

ORT's quantizer takes block sizes only as one global option for every weight (the embedding's Gather and the
norms cannot take blocks), so it quantizes these weights per channel and this pass swaps each one's
DequantizeLinear for the blockwise one: block_size 32 along the input axis, a positive scale per block, zero
point 0 (QNN HTP computes asymmetric 4-bit blocks wrongly; seen on the x86_64 emulator).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from staticlm.export.source_grid import BLOCK, LOWEST_LEVEL, block_sum_name, offsets_name

OFFSETS = offsets_name("")


def grid_weights(float_model: onnx.ModelProto) -> list[str]:
    """The weights the float graph computes as x Wq + (x E) C."""
    suffix = len(OFFSETS)
    return sorted(i.name[:-suffix] for i in float_model.graph.initializer if i.name.endswith(OFFSETS))


def grid_overrides(names: list[str], float_model: onnx.ModelProto) -> dict[str, list[dict]]:
    """Offsets 16-bit per output column (1/32 of the weight's size); the 0/1 block indicator is exact in 8 bits."""
    from onnxruntime.quantization import QuantType

    out = {f"{n}{OFFSETS}": [{"quant_type": QuantType.QInt16, "symmetric": True, "axis": 1}] for n in names}
    for k in {i.dims[0] for i in float_model.graph.initializer if i.name in set(names)}:
        out[block_sum_name(k)] = [{"quant_type": QuantType.QUInt8, "symmetric": False}]
    return out


def _float_value(weights: Path, init: onnx.TensorProto) -> np.ndarray:
    info = {e.key: e.value for e in init.external_data}
    return np.fromfile(weights, dtype=np.float32, count=int(np.prod(init.dims)),
                       offset=int(info["offset"])).reshape(tuple(init.dims))


def _levels_tensor(name: str, levels: np.ndarray, bits: int) -> onnx.TensorProto:
    if bits == 8:
        return numpy_helper.from_array(levels.astype(np.int8), name)
    nibbles = (levels.astype(np.int8).ravel() & 0xF).astype(np.uint8)  # two's complement int4, low nibble first
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return helper.make_tensor(name, onnx.TensorProto.INT4, levels.shape, packed.tobytes(), raw=True)


def _grid_scales(symmetric: np.ndarray) -> np.ndarray:
    """[K/32, N]: a grid block's scale, exactly (its minimum sits at the lowest level)."""
    k, n = symmetric.shape
    return symmetric.reshape(k // BLOCK, BLOCK, n).min(axis=1) / LOWEST_LEVEL


def int4_block_scales(w: np.ndarray) -> np.ndarray:
    """[K/32, N]: the finest positive scale whose levels -8..7 reach both ends of each block of a float weight,
    max(-min / 8, max / 7), so nothing clips and every value rounds to within half a step."""
    k, n = w.shape
    blocks = w.reshape(k // BLOCK, BLOCK, n)
    return np.maximum(-blocks.min(axis=1) / -LOWEST_LEVEL, blocks.max(axis=1) / (-LOWEST_LEVEL - 1))


def to_block_weights(model: onnx.ModelProto, float_model: onnx.ModelProto, weights: Path, *, bits: int,
                     float_blocks: frozenset[str] = frozenset()) -> None:
    """In place: each grid weight's per-channel DequantizeLinear becomes the exact blockwise one, and each of
    float_blocks (4-bit only) its nearest rounding on int4_block_scales."""
    names = set(grid_weights(float_model))
    floats = {i.name: i for i in float_model.graph.initializer}
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        weight = node.input[0].removesuffix("_quantized") if node.op_type == "DequantizeLinear" else None
        if weight not in names and (weight not in float_blocks or floats[weight].dims[0] % BLOCK):
            continue
        value = _float_value(weights, floats[weight])  # [K, N]: the symmetric part of a grid weight
        scales = _grid_scales(value) if weight in names else int4_block_scales(value)
        scales = np.where(scales > 0, scales, np.float32(1)).astype(np.float32)  # a constant block: any scale
        levels = np.clip(np.rint(value / np.repeat(scales, BLOCK, axis=0)), LOWEST_LEVEL, -LOWEST_LEVEL - 1)
        for name, tensor in ((node.input[0], _levels_tensor(node.input[0], levels, bits)),
                             (node.input[1], numpy_helper.from_array(scales, node.input[1])),
                             (node.input[2], _levels_tensor(node.input[2], np.zeros_like(scales), bits))):
            inits[name].CopyFrom(tensor)
        del node.attribute[:]
        node.attribute.extend([helper.make_attribute("axis", 0), helper.make_attribute("block_size", BLOCK)])
