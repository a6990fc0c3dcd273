"""The CPU target's linear layers: which nodes each one is and how its weights are rounded, decided here once
(linear_parts.py writes each node's weights as told).

A linear layer of the graph fuses HF projections along its output axis (`l{i}.qkv` is q, k and v). Each
projection is either a source grid (a GGUF tensor's own levels and scales, sources/gguf_grids.py) or a float
weight that is rounded here. Consecutive projections that share a form become one MatMulNBits node:

- a source grid keeps its container (4 or 8 bits), its block (32 or 16), its levels, scales and zero points
  exactly; a type with minima adds its per-block offsets C [K/32, N] through one float MatMul of x's block
  sums (x W = x Wq + S(x) C), so every exported weight equals gguf's dequantization bit for bit;
- a float weight is rounded by onnxruntime.quantization, with the block-mean correction rows of quant.py.

A Q4_K_M file mixes types inside one linear (q and k Q4_K, v Q6_K): that linear runs two MatMulNBits nodes
whose outputs are concatenated, so no projection is re-rounded to share a grid.

With `CpuOptions.gguf_kernels`, a GGUF tensor of one of BLOCK_TYPES is none of the above: its own blocks are
stored as they are in the file and one GgufMatMul (runtime/kernels) reads them, so a step reads the file's bytes
(their MatMulNBits forms are wider: 8-bit levels for Q6_K's 6, float scales and offsets).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import groupby

import numpy as np

from staticlm.export.sources.gguf_grids import FloatWeight, WeightGrid
from staticlm.export.weight_file import ALIGNMENT, WeightFileWriter
from staticlm.runtime.kernels import GROUPED_TYPES, ROW_GROUP

from .linear_parts import (
    FLOAT_BITS,
    MatMulPart,
    write_block_part,
    write_float_part,
    write_folded_grid_part,
    write_grid_part,
)
from .options import CpuOptions, GridMinima
from .quant import BlockQuantizer

OFFSET_BLOCK = 32  # every type with minima has 32-input blocks
# The GGUF types whose own blocks the kernels read in the exported graphs (runtime/kernels reads more): those whose
# MatMulNBits form is far wider than the file (8-bit levels for 5 and 6 bits, float scales and offsets per 16 or
# 32), and Q4_1 and Q8_0, whose MatMulNBits forms are prepacked into a second copy (a tied table is then held twice:
# its rows for the embedding's gather, its packed form for the head). Q4_0 keeps MatMulNBits, whose form is its
# blocks' size.
BLOCK_TYPES = frozenset({"Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
# ORT packs each MatMulNBits weight anew whenever a session opens, and only then finds that blob in the prepacked
# store (runtime/session/prepacked.py) and frees its own: a node's packed form is memory held at once while a family
# opens (a 150k-row 8-bit tied head packs to 350 MB). A weight with more levels bytes than this runs as several nodes
# over row ranges of the same stored bytes (graph.py), their outputs concatenated: the same columns, computed alike.
MAX_NODE_WEIGHT_BYTES = 32 << 20


@dataclass(frozen=True)
class LinearPlan:
    k: int
    parts: tuple[MatMulPart, ...]
    offsets: str | None = None  # weight name of C [K/32, N], the source grids' per-block offsets

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)


# one fused projection: its source grid (None: none) and its float weight [N_i, K], read only when called (a lazy
# source dequantizes on reading)
Source = tuple[WeightGrid | FloatWeight | None, Callable[[], np.ndarray]]


def write_linear(writer: WeightFileWriter, name: str, sources: list[Source], options: CpuOptions, *,
                 head: bool) -> LinearPlan:
    """sources: per fused projection, in output order. Consecutive projections of one grid_key become one node."""
    kernels = options.gguf_kernels
    groups = [list(members) for _key, members in groupby(sources, key=lambda s: grid_key(s[0], kernels=kernels))]
    parts, ns, offset_grids, k = [], [], [], None
    for j, members in enumerate(groups):
        weight = name if len(groups) == 1 else f"{name}.{j}"
        part, rows, with_offsets, k = _write_node(writer, weight, members, options, head=head, linear=name)
        parts.append(replace(part, node_rows=node_rows(writer, part)))
        ns += rows
        offset_grids += with_offsets
    offsets = grid_offsets(offset_grids, ns=ns, k=k)
    if offsets is not None:
        writer.add(f"{name}.offsets", offsets)  # [K/32, N]
    return LinearPlan(k=k, parts=tuple(parts), offsets=None if offsets is None else f"{name}.offsets")


def _write_node(writer: WeightFileWriter, weight: str, members: list[Source], options: CpuOptions, *, head: bool,
                linear: str) -> tuple[MatMulPart, list[int], list[WeightGrid | FloatWeight | None], int]:
    """One node for projections of one grid_key: the node, each projection's rows N_i, each one's grid whose minima
    the linear's offsets carry (None: its minima are elsewhere, or it has none), and K."""
    grids = [grid for grid, _read in members]
    if grids[0] is None:
        floats = [read() for _grid, read in members]
        w = np.concatenate(floats).T  # [K, N]
        corrected = not head and options.corrects(linear, w.shape[0])
        part = write_float_part(writer, weight, w, _float_quantizer(options, head=head), corrected=corrected)
        return part, [f.shape[0] for f in floats], grids, w.shape[0]
    grid, rows, k = concat_grids(grids), [g.shape[0] for g in grids], grids[0].shape[1]
    if options.gguf_kernels and reads_blocks(grid):
        # a type the kernels dot a group of rows at a time; not the head, whose table the embedding may gather from
        grouped = grid.qtype in GROUPED_TYPES and grid.shape[0] % ROW_GROUP == 0 and not head
        part = write_block_part(writer, weight, grid, row_group=ROW_GROUP if grouped else 0)
        return part, rows, [None] * len(grids), k
    if _folds(grid, options, head=head, linear=linear):
        quant = BlockQuantizer(bits=grid.bits, block_size=grid.block, symmetric=False,
                               accuracy_level=options.accuracy_level)
        return write_folded_grid_part(writer, weight, grid, quant), rows, [None] * len(grids), k
    return write_grid_part(writer, weight, grid), rows, grids, k


def node_rows(writer: WeightFileWriter, part: MatMulPart) -> tuple[int, ...]:
    """The rows of each MatMulNBits node a part runs as: the most rows within MAX_NODE_WEIGHT_BYTES of levels that
    start each range on an ALIGNMENT boundary of every tensor it slices (so each range is mapped in place), the last
    range the rest; () for one node."""
    if part.ggml_type is not None or part.bits == FLOAT_BITS:
        return ()
    lengths = [writer.tensor_bytes(name) for name in node_weights(part)]
    if any(length % part.n for length in lengths):
        return ()
    row_bytes = [length // part.n for length in lengths]
    step = math.lcm(*(ALIGNMENT // math.gcd(ALIGNMENT, b) for b in row_bytes))  # rows a range starts at a multiple of
    rows = max(step, MAX_NODE_WEIGHT_BYTES // row_bytes[0] // step * step)
    if rows >= part.n:
        return ()
    return tuple(min(rows, part.n - start) for start in range(0, part.n, rows))


def node_weights(part: MatMulPart) -> list[str]:
    """A MatMulNBits part's stored tensors, in the node's input order: levels, scales (and zero points)."""
    return [f"{part.weight}.{s}" for s in (("q", "scales", "zp") if part.zero_points else ("q", "scales"))]


def _float_quantizer(options: CpuOptions, *, head: bool) -> BlockQuantizer:
    """How a float weight is rounded: the head's bits and symmetry, or the layers'."""
    return BlockQuantizer(bits=int(options.head if head else options.bits), block_size=options.block_size,
                          symmetric=options.head_symmetric if head else options.symmetric,
                          accuracy_level=options.accuracy_level)


def _folds(grid: WeightGrid | FloatWeight, options: CpuOptions, *, head: bool, linear: str) -> bool:
    return (options.grid_minima is GridMinima.FOLDED and not head and isinstance(grid, WeightGrid)
            and grid.mins is not None and grid.block == OFFSET_BLOCK and options.corrects(linear, grid.shape[1]))


def concat_grids(grids: list[WeightGrid | FloatWeight]) -> WeightGrid | FloatWeight:
    """Grids of one grid_key stacked along the output axis (their GGUF types may differ: Q4_1 and Q4_K)."""
    first = grids[0]
    if len(grids) == 1:
        return first
    qtype = "+".join(dict.fromkeys(g.qtype for g in grids))
    if isinstance(first, FloatWeight):
        return FloatWeight(qtype=qtype, values=np.concatenate([g.values for g in grids]))
    mins = None if first.mins is None else np.concatenate([g.mins for g in grids])
    zeros = None if first.zeros is None else np.concatenate([g.zeros for g in grids])
    same_blocks = all(g.raw is not None for g in grids) and len({g.qtype for g in grids}) == 1
    return WeightGrid(qtype=qtype, block=first.block, levels=np.concatenate([g.levels for g in grids]),
                      scales=np.concatenate([g.scales for g in grids]), mins=mins, mid=first.mid, zeros=zeros,
                      raw=np.concatenate([g.raw for g in grids]) if same_blocks else None)


def grid_key(grid: WeightGrid | FloatWeight | None, *, kernels: bool = False) -> tuple:
    """Projections with equal keys share one node (kernels: a GGUF type the kernels read is its own key)."""
    if grid is None:
        return ("float",)
    if kernels and reads_blocks(grid):
        return ("gguf", grid.qtype)
    if isinstance(grid, FloatWeight):
        return ("exact float",)
    return (grid.bits, grid.block, grid.mid, grid.mins is None, grid.zeros is None)


def reads_blocks(grid: WeightGrid | FloatWeight | None) -> bool:
    """Whether the kernels read grid's own blocks (a GGUF tensor of one of BLOCK_TYPES)."""
    return isinstance(grid, WeightGrid) and grid.raw is not None and grid.qtype in BLOCK_TYPES


def grid_offsets(grids: list[WeightGrid | FloatWeight | None], *, ns: list[int], k: int) -> np.ndarray | None:
    """C [K/32, N] for the projections of one linear (zero for those without minima), or None if none has any."""
    # a grid of larger blocks (a float source's GPTQ blocks of 64 or 128) repeats its offset over each 32 of them
    offsets = [np.repeat(g.offsets(), g.block // OFFSET_BLOCK, axis=1) if isinstance(g, WeightGrid) and
               g.mins is not None else None for g in grids]
    if all(o is None for o in offsets):
        return None
    cols = [o if o is not None else np.zeros((n, k // OFFSET_BLOCK), np.float32) for o, n in zip(offsets, ns)]
    return np.ascontiguousarray(np.concatenate(cols).T)  # [K/32, N]
