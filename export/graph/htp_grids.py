"""The HTP graph's projections that keep their GGUF source's own grid (sources/gguf_grids.py), exactly.

A grid weight w = s (q - mid) [+ mins] is split into its symmetric part and one offset per block of 32 inputs:

    w = s l + c,   l = q - mid,   c = mins + mid s     so     x W = x Wl + (x E) C

Wl is a blockwise DequantizeLinear (levels l, scales s, zero point 0; blocks.py writes it into the quantized
graph from these grids, never from values), E [K, K/32] the 0/1 block indicator and C [K/32, N] the offsets
(types with minima only), a MatMul 1/32 the size of W whose C is quantized 16-bit per column.

HTP takes l at zero point mid (symmetric int4/int8), not the CPU target's per-block zero points: l of a 4-bit
type is in -8..7 (int4), of Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 in -128..127 (int8). Scales keep their sign: QNN HTP takes
negative block scales (Q4_0's d, Q6_K's sub-scales) and computes them as the flipped form (measured on the x86_64
emulator), and flipping Q4_0's level -8 would leave int4. A zero scale becomes 1 over zero levels: the same
zeros, and no zero divisor in QNN's parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from staticlm.export.source_grid import BLOCK as OFFSET_BLOCK
from staticlm.export.sources.gguf_grids import WeightGrid
from staticlm.runtime.family.config import ModelConfig


def offsets_name(weight: str) -> str:
    """The weight file's name for C, the per-block offsets of `weight`."""
    return f"{weight}.block_offsets"


def block_sum_name(k: int) -> str:
    """The weight file's name for E, the [k, k / 32] block indicator."""
    return f"block_sum_{k}"


def output_scale_name(weight: str) -> str:
    """The weight file's name for a scalar the graph multiplies the projection's output by (see q_factor)."""
    return f"{weight}.output_scale"


@dataclass(frozen=True)
class HTPGrid:
    levels: np.ndarray  # [K, N] int8: l, in -8..7 when bits is 4
    scales: np.ndarray  # [K / block, N] float32, nonzero
    block: int  # 32, or 16 with a Q6_K part
    bits: int  # the DequantizeLinear's container: 4 or 8
    offsets: np.ndarray | None  # [K / 32, N] float32 c, or None when no part has minima

    def symmetric_part(self) -> np.ndarray:
        """[K, N] float32 s l: each product exact in float32 (at most 24 significant bits for every GGUF type)."""
        return (self.levels.astype(np.float32) * np.repeat(self.scales, self.block, axis=0)).astype(np.float32)


def _part(grid: WeightGrid, factor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One HF projection's grid [N, K] -> levels [N, K] int8, scales [N, K/block], offsets [N, K/32] or None;
    factor is a power of two, so scaling s and c by it is exact."""
    if grid.zeros is not None:  # HTP takes blockwise weights at zero offset only (blocks.py)
        raise ValueError(f"a {grid.qtype} grid with per-block zero points has no HTP form")
    levels = grid.levels.astype(np.int16) - grid.mid
    zero = grid.scales == 0
    levels[np.repeat(zero, grid.block, axis=1)] = 0
    scales = np.where(zero, np.float32(1), grid.scales * np.float32(factor)).astype(np.float32)
    offsets = None
    if grid.mins is not None:
        offsets = ((grid.mins + np.float32(grid.mid) * grid.scales) * np.float32(factor)).astype(np.float32)
    return levels.astype(np.int8), scales, offsets


def htp_grid(parts: list[WeightGrid], *, factor: float = 1.0, eight_bit: bool = False) -> HTPGrid:
    """The grids of the HF projections one graph weight stacks along its output axis, as [K, N] (the graph's
    [in, out] layout). Parts with blocks of 32 join a Q6_K part at 16 by repeating each scale (exact)."""
    block = min(p.block for p in parts)
    k = parts[0].shape[1]
    levels, scales, offsets = [], [], []
    for p in parts:
        lv, s, c = _part(p, factor)
        levels.append(lv)
        scales.append(np.repeat(s, p.block // block, axis=1))
        offsets.append(c)
    has_offsets = any(c is not None for c in offsets)
    offsets = [c if c is not None else np.zeros((lv.shape[0], k // OFFSET_BLOCK), np.float32)
               for c, lv in zip(offsets, levels)]
    bits = 8 if eight_bit or any(p.bits == 8 for p in parts) else 4
    return HTPGrid(levels=np.ascontiguousarray(np.concatenate(levels).T),
                   scales=np.ascontiguousarray(np.concatenate(scales).T), block=block, bits=bits,
                   offsets=np.ascontiguousarray(np.concatenate(offsets).T) if has_offsets else None)


def q_factor(config: ModelConfig) -> tuple[float, bool]:
    """(the softmax scale folded into a grid q's scales, whether the graph multiplies q by the rest instead).

    A power of two (head_dim 16, 64, 256) scales s and c exactly; any other (head_dim 128: 1/sqrt(128)) would
    round every scale, so the graph multiplies q's output instead. A q norm takes the scale itself
    (graph/llama.py's attention_weights): q's grid stays as it is."""
    scale = config.attention_scale
    if config.qk_norm:
        return 1.0, False
    if math.frexp(scale)[0] == 0.5:
        return scale, False
    return 1.0, True


def projection_sources(config: ModelConfig) -> dict[str, list[tuple[str, slice]]]:
    """Graph weight -> the HF projections (and output rows) it stacks, in output order (htp_style.py's layout)."""
    out = {}
    d = config.head_dim
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        every = slice(None)
        out[f"l{layer}.q"] = [(p + "self_attn.q_proj.weight", every)]
        for kind in ("k", "v"):
            for h in range(config.num_kv_heads):
                out[f"l{layer}.{kind}_h{h}"] = [(p + f"self_attn.{kind}_proj.weight", slice(h * d, (h + 1) * d))]
        out[f"l{layer}.o"] = [(p + "self_attn.o_proj.weight", every)]
        out[f"l{layer}.gate_up"] = [(p + "mlp.gate_proj.weight", every), (p + "mlp.up_proj.weight", every)]
        out[f"l{layer}.down"] = [(p + "mlp.down_proj.weight", every)]
    return out


class ProjectionGrids:
    """The graph weights whose every HF part has a source grid (LoadedModel.grids), each made on demand: the
    float family's weights and the quantized graph's DequantizeLinear are made from the same numbers."""

    def __init__(self, config: ModelConfig, grids: dict, *, eight_bit: bool = False) -> None:
        self.config, self._grids, self.eight_bit = config, grids, eight_bit
        every = projection_sources(config)
        self._sources = {name: parts for name, parts in every.items()
                         if all(isinstance(grids.get(hf), WeightGrid) for hf, _rows in parts)}
        # HF tensors with a grid that a graph weight stacks with a float part (rare: a fused gate_up of two types)
        self.rounded_again = sorted({hf for name, parts in every.items() if name not in self._sources
                                     for hf, _rows in parts if isinstance(grids.get(hf), WeightGrid)})

    def names(self) -> list[str]:
        return sorted(self._sources)

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def bits(self, name: str) -> int:
        """The container of a grid weight's levels (HTPGrid.bits), without making them."""
        parts = self._sources[name]
        return 8 if self.eight_bit or any(self._grids[hf].bits == 8 for hf, _rows in parts) else 4

    def get(self, name: str) -> HTPGrid | None:
        parts = self._sources.get(name)
        if parts is None:
            return None
        factor = q_factor(self.config)[0] if name.endswith(".q") else 1.0
        return htp_grid([self._grids[hf].rows(rows) for hf, rows in parts], factor=factor, eight_bit=self.eight_bit)
