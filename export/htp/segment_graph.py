"""Segmented batched graphs for the HTP target (GraphKind.SEGMENT; contract: runtime/family/segments.py's
static_segment_graph_io): B sequences answering one prompt, its K/V read once for all of them.

HTPLlamaGraph's attention, batched, over two past segments and the new rows, per KV head:
- the prompt segment [1, 1, P_prompt, D] is the first input of one K x Q^T product whose Q^T holds every
  sequence's query rows ([1, 1, D, B g AR]): the window is read once per step for the whole batch, in place,
  never transposed (graph.py's orientation);
- the response buffer [B, 1, P, D] goes into one batched product, each sequence against its own rows;
- the new rows [B, 1, AR, D] likewise.
Their scores are concatenated (floats, never KV rows), the bias [B, 1, AR, P_prompt + P + AR] added, one Softmax,
and the probabilities split back by segment.

New rows: each head's K (its RoPE Add) and V (its MatMul) are computed once for the B sequences, as the compute
ops `new_key_{l}_h{h}` / `new_value_{l}_h{h}` [B, 1, AR, D], pinned to that tensor's family KV parameters; a Split
along the batch gives each sequence's output. The quantizer gives a Split's outputs its input's parameters, so the
outputs carry exactly the pinned ones (checked by tests/test_segment_htp.py) and the K/V projections are read once
per step, not once per sequence.
"""
from __future__ import annotations

import onnx

from staticlm.export.graph.htp_style import HTP_OPSET, HTPLlamaGraph
from staticlm.export.graph.llama import LlamaGraph
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import GraphShape, Role, kv_name
from staticlm.runtime.family.segments import static_segment_graph_io


class FamilyWeights:
    """The float family's weights as its graphs reference them (external data in its weights.bin): what a
    GraphBuilder asks of a WeightFileWriter, after the file is written."""

    def __init__(self, float_graph: onnx.ModelProto) -> None:
        self._protos = {i.name: i for i in float_graph.graph.initializer if i.external_data}

    def __contains__(self, name: str) -> bool:
        return name in self._protos

    def proto(self, name: str) -> onnx.TensorProto:
        out = onnx.TensorProto()
        out.CopyFrom(self._protos[name])
        return out


class HTPSegmentGraph(HTPLlamaGraph):
    def __init__(self, config: ModelConfig, shape: GraphShape, *, prompt_len: int, weights) -> None:
        if shape.batch < 2:
            raise ValueError(f"a segmented graph is batched, got batch {shape.batch}")
        LlamaGraph.__init__(self, config, shape, weights=weights)
        self.g.opset = HTP_OPSET
        self.prompt_len = prompt_len

    def io(self):
        return static_segment_graph_io(self.c, self.s, prompt_len=self.prompt_len)

    def head_norm(self, x: str, layer: int, kind: str) -> str:
        if not self.c.qk_norm:
            return x
        s, c = self.s, self.c
        shape = [s.batch, s.ar, c.num_heads, c.head_dim] if kind == "q" else [s.batch, 1, s.ar, c.head_dim]
        return self._norm(x, f"l{layer}.{kind}_norm", shape=shape)

    def attention(self, layer: int, x: str, cos: str, sin: str, bias: str) -> str:
        g, c, s = self.g, self.c, self.s
        b, ar, pp, p, grp, d, hkv = s.batch, s.ar, self.prompt_len, s.past_len, c.group_size, c.head_dim, c.num_kv_heads
        x4 = g.op("Reshape", x, g.const([b, 1, ar, c.hidden_size]))  # [B, 1, AR, hidden]
        q = self.linear(x, f"l{layer}.q")  # [B, AR, H D]
        if c.attention_bias:
            q = g.op("Add", q, g.weight(f"l{layer}.q_bias"))
        q = self.rope(self.heads(q, c.num_heads, norm=(layer, "q")), cos, sin)  # [B, H, AR, D]
        q_groups = [q] if hkv == 1 else g.op("Split", q, g.const([grp] * hkv), axis=1, num_outputs=hkv)
        outs = []
        for h in range(hkv):  # builds per-KV-head attention; not a runtime loop
            kb = f"l{layer}.k_bias_h{h}" if c.attention_bias else None
            vb = f"l{layer}.v_bias_h{h}" if c.attention_bias else None
            k = self.head_norm(self._project(x4, f"l{layer}.k_h{h}", kb, None), layer, "k")  # [B, 1, AR, D]
            new_k = self.rope(k, cos, sin, out=kv_name(Role.NEW_KEY, layer, h))  # pinned: [B, 1, AR, D]
            new_v = self._project(x4, f"l{layer}.v_h{h}", vb, kv_name(Role.NEW_VALUE, layer, h))  # pinned
            for t, role in ((new_k, Role.NEW_KEY), (new_v, Role.NEW_VALUE)):  # each sequence's [1, 1, AR, D]
                g.op("Split", t, g.const([1] * b), axis=0, outputs=[kv_name(role, layer, h, seq) for seq in range(b)])
            qg = g.op("Reshape", q_groups[h], g.const([b, 1, grp * ar, d]))  # [B, 1, g AR, D]
            q_t = g.op("Transpose", qg, perm=[0, 1, 3, 2])  # [B, 1, D, g AR]
            q_all_t = g.op("Transpose", g.op("Reshape", qg, g.const([1, 1, b * grp * ar, d])),
                           perm=[0, 1, 3, 2])  # [1, 1, D, B g AR]: every sequence's queries
            s_prompt = g.op("MatMul", kv_name(Role.PROMPT_KEY, layer, h), q_all_t)  # [1, 1, Pp, B g AR]
            s_prompt = g.op("Reshape", g.op("Transpose", s_prompt, perm=[0, 1, 3, 2]),
                            g.const([b, grp, ar, pp]))  # [B, g, AR, Pp]
            s_resp = g.op("MatMul", kv_name(Role.PAST_KEY, layer, h), q_t)  # [B, 1, P, g AR]
            s_new = g.op("MatMul", new_k, q_t)  # [B, 1, AR, g AR]
            s_own = g.op("Transpose", g.op("Concat", s_resp, s_new, axis=2), perm=[0, 1, 3, 2])  # [B, 1, gAR, P+AR]
            s_own = g.op("Reshape", s_own, g.const([b, grp, ar, p + ar]))  # [B, g, AR, P + AR]
            scores = g.op("Add", g.op("Concat", s_prompt, s_own, axis=-1), bias)  # [B, g, AR, Pp + P + AR]
            probs = g.op("Softmax", scores, axis=-1)
            p_prompt, p_resp, p_new = g.op("Split", probs, g.const([pp, p, ar]), axis=-1, num_outputs=3)
            o_prompt = g.op("MatMul", g.op("Reshape", p_prompt, g.const([1, 1, b * grp * ar, pp])),
                            kv_name(Role.PROMPT_VALUE, layer, h))  # [1, 1, B g AR, D]
            o_prompt = g.op("Reshape", o_prompt, g.const([b, grp, ar, d]))  # [B, g, AR, D]
            o_resp = g.op("MatMul", p_resp, kv_name(Role.PAST_VALUE, layer, h))  # [B, g, AR, D]
            outs.append(g.op("Add", g.op("Add", o_prompt, o_resp), g.op("MatMul", p_new, new_v)))  # [B, g, AR, D]
        o = outs[0] if hkv == 1 else g.op("Concat", *outs, axis=1)  # [B, H, AR, D]
        o = g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), g.const([b, ar, c.num_heads * d]))
        return self.linear(o, f"l{layer}.o")
