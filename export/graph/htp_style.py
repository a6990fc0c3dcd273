"""The Llama graph restructured for a quantized HTP family: what the HTP backend runs well.

Differences from export/graph/llama.py's LlamaGraph, each for a reason:
- K and V are projected per KV head (one [hidden, D] weight each), so every `new_key_{l}_h{h}` is the
  output of its own RoPE Add and every `new_value_{l}_h{h}` of its own MatMul. A tensor made by a
  data-movement op (Split, Reshape) must share its producer's quantization parameters; a compute op's
  output can take the KV tensor's pinned scale/zero-point, so the new rows leave the graph with exactly
  the parameters their past window comes in with, and nothing requantizes them.
- Scores are K x Q^T (the past window is the MatMul's first input, read as is) and the small score
  block is transposed, never the [P, D] window: a Transpose on HTP would copy the cache every step.
  The second inputs of these MatMuls (Q^T, V) are given an int16 copy after quantization (HTP takes a
  uint16 one at 8 bits: qdq.signed_matmul_operands).
- RMSNorm is SimplifiedLayerNormalization (QNN's RmsNorm): a quantized x^2 / mean / sqrt chain loses
  the variance's precision in 16 bits when the hidden state has outliers.
Batch 1 only; the batched graphs are segmented (segment_graph.py: the prompt K/V shared by every sequence).
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import helper

from staticlm.export.graph.htp_grids import (
    ProjectionGrids,
    block_sum_name,
    offsets_name,
    output_scale_name,
    q_factor,
)
from staticlm.export.graph.llama import LlamaGraph, attention_weights, layer_norms
from staticlm.export.source_grid import block_indicator
from staticlm.export.weight_file import WeightFileWriter
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import GraphShape, Role, graph_io, kv_name

HTP_OPSET = 21
HEAD_BLOCK_ROWS = 64  # rows of the transposed head written at a time


def _add_projection(writer: WeightFileWriter, name: str, w: np.ndarray, grids: ProjectionGrids) -> None:
    """An [in, out] projection; one with a source grid (htp_grids.py) is stored as its symmetric part, plus block
    offsets for types with minima, which HTPLlamaGraph.linear reads (blocks.py makes the exact blockwise
    DequantizeLinear from the same grid)."""
    grid = grids.get(name)
    if grid is None:
        writer.add(name, w)
        return
    writer.add(name, grid.symmetric_part())
    if grid.offsets is not None:
        writer.add(offsets_name(name), grid.offsets)  # [K/32, N]
        if block_sum_name(w.shape[0]) not in writer:
            writer.add(block_sum_name(w.shape[0]), block_indicator(w.shape[0]))  # [K, K/32]


def write_htp_weights(config: ModelConfig, model, *, writer: WeightFileWriter) -> None:
    """Like export/graph/llama.py's write_weights, but Q, each K head and each V head are separate [in, out] tensors.

    model: a LoadedModel (HF-named float32 `weights`, and the source's exact `grids`)."""
    c, f32, hf = config, np.float32, model.weights
    grids = ProjectionGrids(config, model.grids)
    if grids.rounded_again:
        warnings.warn(f"{len(grids.rounded_again)} quantized tensors share an HTP weight with a float one: rounded "
                      "again as a float source", stacklevel=2)
    # Tied or not, the head gets its own [hidden, V] table: quantized per vocab column it keeps the logits'
    # order (one per-tensor 8-bit table for Gather and head cost SmolLM2 top-1 agreement; QNN's Gather
    # cannot read a per-column table). The quantized copy costs 2 V x hidden bytes (16-bit: 56 MB for SmolLM2).
    # Each table read once and written as it is (no float32 copy of it): a 3B model's is 1.2 GB.
    writer.add("embed", np.asarray(hf["model.embed_tokens.weight"], f32))
    head = hf["model.embed_tokens.weight"] if c.tie_word_embeddings else hf["lm_head.weight"]  # [V, hidden]
    blocks = (head[:, a:a + HEAD_BLOCK_ROWS].T for a in range(0, head.shape[1], HEAD_BLOCK_ROWS))  # [rows, V]
    writer.add_blocks("lm_head_t", f32, head.shape[::-1], blocks)
    del head
    writer.add("final_norm", hf["model.norm.weight"].astype(f32))
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        a = attention_weights(c, hf, layer)  # the softmax scale folded in, as in the float family
        for name, hf_name in layer_norms(c, layer).items():  # attn_norm, mlp_norm (and Gemma's post norms)
            writer.add(name, hf[hf_name].astype(f32))
        # A grid q takes the softmax scale in its scales where that is exact, else as a Mul (grids.q_factor)
        _add_projection(writer, f"l{layer}.q", a["q"].T.astype(f32), grids)
        if f"l{layer}.q" in grids and q_factor(c)[1]:
            writer.add(output_scale_name(f"l{layer}.q"), np.array([c.attention_scale], f32))
        if c.attention_bias:
            writer.add(f"l{layer}.q_bias", a["q_bias"])
        if c.qk_norm:
            writer.add(f"l{layer}.q_norm", a["q_norm"])  # [D]
            writer.add(f"l{layer}.k_norm", a["k_norm"])  # [D]
        for kind in ("k", "v"):
            w = a[kind]  # [Hkv D, hidden]
            for h in range(c.num_kv_heads):
                rows = slice(h * c.head_dim, (h + 1) * c.head_dim)
                _add_projection(writer, f"l{layer}.{kind}_h{h}", w[rows].T.astype(f32), grids)  # [hidden, D]
                if c.attention_bias:
                    writer.add(f"l{layer}.{kind}_bias_h{h}", a[f"{kind}_bias"][rows])
        _add_projection(writer, f"l{layer}.o", hf[p + "self_attn.o_proj.weight"].T.astype(f32), grids)
        gate_up = np.concatenate([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        _add_projection(writer, f"l{layer}.gate_up", gate_up.T.astype(f32), grids)
        _add_projection(writer, f"l{layer}.down", hf[p + "mlp.down_proj.weight"].T.astype(f32), grids)


class HTPLlamaGraph(LlamaGraph):
    def __init__(self, config: ModelConfig, shape: GraphShape, *, weights: WeightFileWriter) -> None:
        if shape.batch != 1:
            raise ValueError("the HTP graph style has no batched graphs")
        super().__init__(config, shape, weights=weights)
        # 16-bit Q/DQ are standard from opset 21; building there spares the quantizer's version conversion
        # (which does not know SimplifiedLayerNormalization).
        self.g.opset = HTP_OPSET

    def io(self):
        """The graph's inputs and outputs (segment_graph.py's batched graphs have their own)."""
        return graph_io(self.c, self.s)

    def rms_norm(self, x: str, weight: str) -> str:
        return self._norm(x, weight, shape=[self.s.batch, self.s.ar, self.c.hidden_size])

    def head_norm(self, x: str, layer: int, kind: str) -> str:
        """q [1, AR, H, D] (heads' order before their Transpose) or one k head [1, 1, AR, D]: the q/k norm when the
        architecture has one."""
        if not self.c.qk_norm:
            return x
        shape = [1, self.s.ar, self.c.num_heads, self.c.head_dim] if kind == "q" else [1, 1, self.s.ar, self.c.head_dim]
        return self._norm(x, f"l{layer}.{kind}_norm", shape=shape)

    def _norm(self, x: str, weight: str, *, shape: list[int]) -> str:
        y = self.g.op("SimplifiedLayerNormalization", x, self.g.weight(weight), axis=-1,
                      epsilon=float(self.c.rms_norm_eps), stash_type=1)
        self._norm_outputs.append((y, shape))
        return y

    def build(self, name: str):
        """As LlamaGraph.build, but the head is a MatMul over its own [hidden, V] table: QNN HTP rejects the
        16-bit x 8-bit Gemm(transB) (FullyConnected, validation error 3110)."""
        g, s = self.g, self.s
        self._norm_outputs: list[tuple[str, list[int]]] = []  # each with its shape
        self._block_sums: dict[str, str] = {}  # input -> its block sums
        inputs, outputs = self.io()
        head = g.weight("lm_head_t")  # [hidden, V]
        h = self.decoder(self.scale_embedding(self.embed("input_ids")))  # [B, AR, hidden], final-normed
        g.op("MatMul", h, head, outputs=["logits"])  # [B, AR, V]
        model = g.model(name=name, inputs=inputs, outputs=outputs,
                        doc=f"staticlm {name} (HTP style): AR={s.ar}, P={s.past_len}, S={s.context}")
        # onnx shape inference does not know this ORT op; without a declared type the quantizer skips
        # every tensor downstream of it (the final norm feeds the lm_head).
        model.graph.value_info.extend(helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, shape)
                                      for y, shape in self._norm_outputs)
        return model

    def linear(self, x: str, weight: str, *, out: str | None = None) -> str:
        """x @ W; for a source grid with minima x @ Wl + (x E) @ C (htp_grids.py); times the weight's output scale
        where it has one (a grid q's softmax scale that its scales cannot take exactly)."""
        g = self.g
        named = {"outputs": [out]} if out else {}
        has_offsets, scaled = offsets_name(weight) in g.weights, output_scale_name(weight) in g.weights
        y = g.op("MatMul", x, g.weight(weight), **({} if has_offsets or scaled else named))
        if has_offsets:
            k = g.weights.proto(weight).dims[0]
            if x not in self._block_sums:  # [.., K/32]: once per input, shared by the weights that read it
                self._block_sums[x] = g.op("MatMul", x, g.weight(block_sum_name(k)))
            offsets = g.op("MatMul", self._block_sums[x], g.weight(offsets_name(weight)))
            y = g.op("Add", y, offsets, **({} if scaled else named))
        if scaled:
            y = g.op("Mul", y, g.weight(output_scale_name(weight)), **named)
        return out or y

    def _project(self, x4: str, weight: str, bias: str | None, out: str | None) -> str:
        """[1, 1, AR, hidden] x [hidden, D] (+ bias); out names the result (a graph output)."""
        if bias is None:
            return self.linear(x4, weight, out=out)
        y = self.g.op("Add", self.linear(x4, weight), self.g.weight(bias), **({"outputs": [out]} if out else {}))
        return out or y

    def attention(self, layer: int, x: str, cos: str, sin: str, bias: str) -> str:
        g, c, s = self.g, self.c, self.s
        ar, p, grp, d = s.ar, c.layer_past_len(layer, s.past_len), c.group_size, c.head_dim
        x4 = g.op("Reshape", x, g.const([1, 1, ar, c.hidden_size]))  # [1, 1, AR, hidden]
        q = self.linear(x, f"l{layer}.q")  # [1, AR, H D]
        if c.attention_bias:
            q = g.op("Add", q, g.weight(f"l{layer}.q_bias"))
        q = self.rope(self.heads(q, c.num_heads, norm=(layer, "q")), cos, sin)  # [1, H, AR, D]
        hkv = c.num_kv_heads
        q_groups = [q] if hkv == 1 else g.op("Split", q, g.const([grp] * hkv), axis=1, num_outputs=hkv)
        outs = []
        for h in range(hkv):  # builds per-KV-head attention; not a runtime loop
            kb = f"l{layer}.k_bias_h{h}" if c.attention_bias else None
            vb = f"l{layer}.v_bias_h{h}" if c.attention_bias else None
            k = self.head_norm(self._project(x4, f"l{layer}.k_h{h}", kb, None), layer, "k")  # [1, 1, AR, D]
            new_k = self.rope(k, cos, sin, out=kv_name(Role.NEW_KEY, layer, h))
            new_v = self._project(x4, f"l{layer}.v_h{h}", vb, kv_name(Role.NEW_VALUE, layer, h))
            past_k, past_v = kv_name(Role.PAST_KEY, layer, h), kv_name(Role.PAST_VALUE, layer, h)
            q_t = g.op("Transpose", g.op("Reshape", q_groups[h], g.const([1, 1, grp * ar, d])), perm=[0, 1, 3, 2])
            s_past = g.op("MatMul", past_k, q_t)  # [1, 1, P, g AR]: the window read in place
            s_new = g.op("MatMul", new_k, q_t)  # [1, 1, AR, g AR]
            scores = g.op("Transpose", g.op("Concat", s_past, s_new, axis=2), perm=[0, 1, 3, 2])  # [1, 1, gAR, P+AR]
            scores = g.op("Add", g.op("Reshape", scores, g.const([1, grp, ar, p + ar])), bias)  # [1, g, AR, P+AR]
            probs = g.op("Softmax", scores, axis=-1)
            p_past, p_new = g.op("Split", probs, g.const([p, ar]), axis=-1, num_outputs=2)
            outs.append(g.op("Add", g.op("MatMul", p_past, past_v), g.op("MatMul", p_new, new_v)))  # [1, g, AR, D]
        o = outs[0] if hkv == 1 else g.op("Concat", *outs, axis=1)  # [1, H, AR, D]
        o = g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), g.const([1, ar, c.num_heads * d]))
        return self.linear(o, f"l{layer}.o")
