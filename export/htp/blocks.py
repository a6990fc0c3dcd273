"""Blockwise weights in a quantized graph: a GGUF source's own grids (graph/htp_grids.py), kept exactly, and the 4-bit
weights of a float source.

ORT's quantizer takes block sizes only as one global option for every weight (the embedding's Gather and the
norms cannot take blocks), so it quantizes these weights per channel and this pass swaps each one's
DequantizeLinear for the blockwise one along the input axis, zero point 0 (QNN HTP computes asymmetric 4-bit
blocks wrongly; seen on the x86_64 emulator):
- a source grid: its levels and scales as the source holds them (grids.HTPGrid), int4 or int8, blocks of 32 or
  16 inputs. QNN HTP takes each of these forms, and negative scales, with CPU fallback disabled (the x86_64
  emulator, onnxruntime-qnn 2.7.0), so no grid is rounded again;
- a float source's 4-bit weight: blocks of 32, the nearest rounding on int4_block_scales.
The file holds the grids exactly; HTP's own arithmetic on blockwise weights is not exact (the emulator computes
each weight to about 2^-11 of itself, where a per-channel int8 weight is computed exactly).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from staticlm.export.graph.htp_grids import ProjectionGrids, block_sum_name, offsets_name, output_scale_name

FLOAT_BLOCK = 32  # a float source's 4-bit blocks
LOWEST_INT4 = -8


def grid_overrides(grids: ProjectionGrids, float_model: onnx.ModelProto) -> dict[str, list[dict]]:
    """The quantizer's types for what the grids add to the float graph: each grid weight in its own container
    (replaced by to_block_weights), offsets 16-bit per output column (1/32 of the weight's size), the 0/1 block
    indicator 8-bit (exact), a q's output scale 16-bit."""
    from onnxruntime.quantization import QuantType

    present = {i.name: i for i in float_model.graph.initializer}
    out = {}
    for name in grids.names():
        container = QuantType.QInt4 if grids.bits(name) == 4 else QuantType.QInt8
        out[name] = [{"quant_type": container, "symmetric": True, "axis": 1}]
        if offsets_name(name) in present:
            out[offsets_name(name)] = [{"quant_type": QuantType.QInt16, "symmetric": True, "axis": 1}]
            out[block_sum_name(present[name].dims[0])] = [{"quant_type": QuantType.QUInt8, "symmetric": False}]
        if output_scale_name(name) in present:
            out[output_scale_name(name)] = [{"quant_type": QuantType.QUInt16, "symmetric": False}]
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


def int4_block_scales(w: np.ndarray) -> np.ndarray:
    """[K/32, N]: the finest positive scale whose levels -8..7 reach both ends of each block of a float weight,
    max(-min / 8, max / 7), so nothing clips and every value rounds to within half a step."""
    k, n = w.shape
    blocks = w.reshape(k // FLOAT_BLOCK, FLOAT_BLOCK, n)
    return np.maximum(-blocks.min(axis=1) / -LOWEST_INT4, blocks.max(axis=1) / (-LOWEST_INT4 - 1))


def _float_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scales = int4_block_scales(w)
    scales = np.where(scales > 0, scales, np.float32(1)).astype(np.float32)  # a constant block: any scale
    levels = np.clip(np.rint(w / np.repeat(scales, FLOAT_BLOCK, axis=0)), LOWEST_INT4, -LOWEST_INT4 - 1)
    return levels, scales


def to_block_weights(model: onnx.ModelProto, float_model: onnx.ModelProto, weights: Path, *,
                     grids: ProjectionGrids, float_blocks: frozenset[str] = frozenset()) -> None:
    """In place: each grid weight's per-channel DequantizeLinear becomes its source's blockwise one, and each of
    float_blocks its nearest 4-bit rounding on int4_block_scales (weights: the float family's weight file)."""
    floats = {i.name: i for i in float_model.graph.initializer}
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        weight = node.input[0].removesuffix("_quantized") if node.op_type == "DequantizeLinear" else None
        grid = grids.get(weight) if weight in grids else None
        if grid is not None:
            levels, scales, bits, block = grid.levels, grid.scales, grid.bits, grid.block
        elif weight in float_blocks and floats[weight].dims[0] % FLOAT_BLOCK == 0:
            levels, scales = _float_blocks(_float_value(weights, floats[weight]))
            bits, block = 4, FLOAT_BLOCK
        else:
            continue
        for name, tensor in ((node.input[0], _levels_tensor(node.input[0], levels, bits)),
                             (node.input[1], numpy_helper.from_array(scales, node.input[1])),
                             (node.input[2], _levels_tensor(node.input[2], np.zeros_like(scales), bits))):
            inits[name].CopyFrom(tensor)
        del node.attribute[:]
        node.attribute.extend([helper.make_attribute("axis", 0), helper.make_attribute("block_size", block)])

