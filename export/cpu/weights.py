"""The CPU target's weight file: every linear layer's MatMulNBits weights (linears.py), norms, biases and RoPE.

1/sqrt(head_dim) is not folded into Wq here (the attention ops take it as their scale): folding would change a
source grid's scales, which must stay gguf's own.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import groupby

import numpy as np

from staticlm.export.graph.llama import layer_norms
from staticlm.export.sources.gguf_grids import FloatWeight, WeightGrid
from staticlm.export.weight_file import WeightFileWriter
from staticlm.runtime.family.config import ModelConfig

from .linears import (
    OFFSET_BLOCK,
    LinearPlan,
    MatMulPart,
    concat_grids,
    grid_key,
    grid_offsets,
    reads_blocks,
    write_block_part,
    write_folded_grid_part,
    write_grid_part,
)
from .options import CpuAttention, CpuOptions, GridMinima
from .quant import BlockQuantizer
from .rope import rope_weights

HEAD = "head_t"  # the head's linear [hidden, V]; a tied embedding gathers from its table
EMBED = "embed"  # an untied embedding's own table
# The graph's linear layers and the HF projections each fuses along its output axis.
LAYER_LINEARS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                 "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def write_cpu_weights(config: ModelConfig, model, writer: WeightFileWriter, options: CpuOptions, *,
                      on_layer: Callable[[int], None] = lambda layer: None) -> dict[str, LinearPlan]:
    """Write every weight once, for every graph to reference; returns each linear's plan (by graph weight name,
    plus EMBED: the table the embedding gathers from).

    model: a LoadedModel (HF-named float32 `weights`, and the source's exact `grids`).
    """
    options.validate(config.hidden_size)
    hf, grids, f32 = model.weights, model.grids, np.float32
    plans: dict[str, LinearPlan] = {}

    def linear(name: str, sources: list[str], *, head: bool = False) -> None:
        # a source's float values are read only where it has no grid (a lazy source dequantizes on reading)
        plans[name] = write_linear(writer, name, [(grids.get(s), partial(hf.__getitem__, s)) for s in sources],
                                   options, head=head)

    writer.add("final_norm", hf["model.norm.weight"].astype(f32))
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for name, hf_name in layer_norms(config, layer).items():  # attn_norm, mlp_norm (and Gemma's post norms)
            writer.add(name, hf[hf_name].astype(f32))
        for kind, projections in LAYER_LINEARS.items():
            linear(f"l{layer}.{kind}", [f"{p}{proj}.weight" for proj in projections])
        if config.attention_bias:
            bias = np.concatenate([hf[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"])
            writer.add(f"l{layer}.qkv_bias", bias.astype(f32))
        if config.qk_norm:  # [D] each
            writer.add(f"l{layer}.q_norm", hf[p + "self_attn.q_norm.weight"].astype(f32))
            writer.add(f"l{layer}.k_norm", hf[p + "self_attn.k_norm.weight"].astype(f32))
        on_layer(layer)
    linear(HEAD, ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"], head=True)
    if config.tie_word_embeddings:
        plans[EMBED] = plans[HEAD]
    else:
        linear(EMBED, ["model.embed_tokens.weight"], head=True)
    if options.attention is CpuAttention.GQA:  # the in-place graphs' RoPE tables (rope.py), shared by every graph
        for name, table in rope_weights(config).items():
            writer.add(name, table)
    return plans


def write_linear(writer: WeightFileWriter, name: str,
                 sources: list[tuple[WeightGrid | FloatWeight | None, Callable[[], np.ndarray]]], options: CpuOptions,
                 *, head: bool) -> LinearPlan:
    """sources: (its grid or None, its float weight [N_i, K] when read) per fused projection, in output order."""
    parts, ns, k = [], [], None
    folded: set[int] = set()  # the grids whose minima are not offsets: in correction rows, or in their own blocks
    kernels = options.gguf_kernels
    groups = [list(members) for _key, members in groupby(sources, key=lambda s: grid_key(s[0], kernels=kernels))]
    for j, members in enumerate(groups):
        weight = name if len(groups) == 1 else f"{name}.{j}"
        if members[0][0] is None:
            floats = [read() for _grid, read in members]
            ns += [w.shape[0] for w in floats]
            w = np.concatenate(floats).T  # [K, N]
            parts.append(write_float_part(writer, weight, w, options, head=head, linear=name))
        else:
            grids = [grid for grid, _read in members]
            ns += [g.shape[0] for g in grids]
            grid = concat_grids(grids)
            if kernels and reads_blocks(grid):
                parts.append(write_block_part(writer, weight, grid, head=head))
                folded.update(id(g) for g in grids)
            elif _folds(grid, options, head=head, linear=name):
                quant = BlockQuantizer(bits=grid.bits, block_size=grid.block, symmetric=False,
                                       accuracy_level=options.accuracy_level)
                parts.append(write_folded_grid_part(writer, weight, grid, quant))
                folded.update(id(g) for g in grids)
            else:
                parts.append(write_grid_part(writer, weight, grid))
        k = w.shape[0] if members[0][0] is None else grids[0].shape[1]
    offsets = grid_offsets([None if id(grid) in folded else grid for grid, _read in sources], ns=ns, k=k)
    if offsets is not None:
        writer.add(f"{name}.offsets", offsets)  # [K/32, N]
    return LinearPlan(k=k, parts=tuple(parts), offsets=None if offsets is None else f"{name}.offsets")


def _folds(grid: WeightGrid | FloatWeight, options: CpuOptions, *, head: bool, linear: str) -> bool:
    return (options.grid_minima is GridMinima.FOLDED and not head and isinstance(grid, WeightGrid)
            and grid.mins is not None and grid.block == OFFSET_BLOCK and options.corrects(linear, grid.shape[1]))


def write_float_part(writer: WeightFileWriter, weight: str, w: np.ndarray, options: CpuOptions, *, head: bool,
                     linear: str) -> MatMulPart:
    """A float weight w [K, N], rounded by onnxruntime.quantization (with correction rows where options say)."""
    bits = int(options.head if head else options.bits)
    symmetric = options.head_symmetric if head else options.symmetric
    quant = BlockQuantizer(bits=bits, block_size=options.block_size, symmetric=symmetric,
                           accuracy_level=options.accuracy_level)
    corrected = not head and options.corrects(linear, w.shape[0])
    if corrected:
        w = quant.corrected(w)  # [K + correction_rows, N]
    packed, scales, zero_points = quant.quantize(w)
    writer.add(f"{weight}.q", packed)
    writer.add(f"{weight}.scales", scales)
    if zero_points is not None:
        writer.add(f"{weight}.zp", zero_points)
    return MatMulPart(weight=weight, n=w.shape[1], bits=bits, block=options.block_size,
                     zero_points=zero_points is not None, corrected=corrected, symmetric=symmetric)
