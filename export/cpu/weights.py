"""The CPU target's weight file: every linear layer (its nodes' weights as linears.py decides), norms, biases and
RoPE.

1/sqrt(head_dim) is not folded into Wq here (the attention ops take it as their scale): folding would change a
source grid's scales, which must stay gguf's own.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from staticlm.export.graph.llama import layer_norms
from staticlm.export.weight_file import WeightFileWriter
from staticlm.runtime.family.config import ModelConfig

from .linears import LinearPlan, write_linear
from .options import CpuAttention, CpuOptions
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
