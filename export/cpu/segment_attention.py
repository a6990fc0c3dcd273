"""Segmented batched graphs for `--target cpu` (GraphKind.SEGMENT; runtime/family/segments.py has the contract).

Attention over two past segments and the new rows, one softmax:

- the prompt segment [P_prompt, D] per KV head, shared: a 2-D right operand, so ORT's MatMul folds the B
  sequences' query rows of that head into one product's rows, and each prompt head is read once per step for the
  whole batch (the prompt's K/V are the largest tensors a step reads);
- the response buffer [B, Hkv, P, D] per (layer, K|V), every sequence and head in one product;
- the new rows, all heads and sequences at once.

Their scores are concatenated along the key axis (floats, never KV rows), the bias [B, 1, g AR, P + AR] is added
to the response and new-row part, one Softmax, and the probabilities are split back by segment.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import TensorProto

from staticlm.runtime.family.contract import KV_INPUT_ROLES, GraphShape, Role, buffer_name, kv_name
from staticlm.runtime.family.manifest import GraphEntry, GraphKind, file_sha256
from staticlm.runtime.family.segments import PROMPT_ROLES, segment_graph_io
from staticlm.runtime.kernels import DOMAIN as KERNEL_DOMAIN

from .attention import MS_DOMAIN, RopeTables, from_heads, qkv_heads, to_heads
from .gqa import attention_op, rotated_qkv
from .graph import BIAS_DIM, PAST_DIM, CpuLlamaGraph, add_opsets

PROMPT_DIM = "prompt_len"
LOCAL_BIAS_DIM = "prompt_len_plus_past_len_plus_ar"


def _split(graph: CpuLlamaGraph, x: str, n: int, axis: int, **kw) -> list[str]:
    if n == 1 and "outputs" not in kw:
        return [x]
    if "outputs" in kw:
        graph.g.op("Split", x, graph.g.const([1] * n), axis=axis, **kw)
        return kw["outputs"]
    return graph.g.op("Split", x, graph.g.const([1] * n), axis=axis, num_outputs=n)


def _cat(graph: CpuLlamaGraph, parts: list[str], axis: int) -> str:
    return parts[0] if len(parts) == 1 else graph.g.op("Concat", *parts, axis=axis)


class SegmentCpuGraph(CpuLlamaGraph):
    """CpuLlamaGraph with the segmented attention body; the weights, linears, embedding and head are the family's."""

    _segment_sizes: str | None = None

    def _sizes(self) -> str:
        """[3]: P_prompt, P, AR (both past lengths symbolic: read once per graph from the inputs' shapes)."""
        if self._segment_sizes is None:
            g = self.g

            def rows(name: str, axis: int) -> str:
                return g.op("Slice", g.op("Shape", name), g.const([axis]), g.const([axis + 1]))

            self._segment_sizes = g.op("Concat", rows(kv_name(Role.PROMPT_KEY, 0, 0), 0),
                                       rows(buffer_name(Role.PAST_KEY, 0), 2), g.const([self.s.ar]), axis=0)
        return self._segment_sizes

    def layer_attention(self, layer: int, x: str) -> str:
        local = self.c.is_local(layer)
        if self.options.staticlm_attention:
            if local:
                raise ValueError("staticlm's SegmentAttention has no sliding window: a local layer's segmented "
                                 "graph attends with ORT's ops")
            return self.segment_attention(layer, x, rope=self.rope_tables())
        return self.attention(layer, x, rope=self.rope_tables(local=local), bias=self.grouped_bias(local=local),
                              local=local)

    def attention(self, layer: int, x: str, *, rope: RopeTables, bias: str, local: bool = False) -> str:
        """local: bias (attention_bias_local) masks the prompt's rows too, [B, 1, g AR, Pp + P + AR]; else it covers
        the response and new rows only, the prompt all seen."""
        g, c, s = self.g, self.c, self.s
        b, hkv, d = s.batch, c.num_kv_heads, c.head_dim
        q, k, v = qkv_heads(self, layer, x, rope=rope)  # [B, Hkv, g AR, D], [B, Hkv, AR, D] x 2
        for t, role in ((k, Role.NEW_KEY), (v, Role.NEW_VALUE)):  # the new rows, one [1, 1, AR, D] per slot
            rows = g.op("Reshape", self._stored(t), g.const([b * hkv, 1, s.ar, d]))  # [B Hkv, 1, AR, D], same bytes
            _split(self, rows, b * hkv, axis=0,
                   outputs=[kv_name(role, layer, h, seq) for seq in range(b) for h in range(hkv)])
        q_heads = _split(self, q, hkv, axis=1)  # each [B, 1, g AR, D]
        alpha = c.attention_scale
        s_prompt = _cat(self, [g.op("FusedMatMul", q_heads[h], self._read(kv_name(Role.PROMPT_KEY, layer, h)),
                                    domain=MS_DOMAIN, transB=1, alpha=alpha) for h in range(hkv)],
                        axis=1)  # [B, Hkv, g AR, Pp]
        # the response buffer, every sequence and head in one product, read in place (transB: no Transpose)
        s_resp = g.op("FusedMatMul", q, self._read(buffer_name(Role.PAST_KEY, layer)), domain=MS_DOMAIN, transB=1,
                      alpha=alpha)  # [B, Hkv, g AR, P]
        s_new = g.op("FusedMatMul", q, k, domain=MS_DOMAIN, transB=1, alpha=alpha)  # [B, Hkv, g AR, AR]
        if local:
            scores = g.op("Add", g.op("Concat", s_prompt, s_resp, s_new, axis=-1), bias)  # [B, Hkv, g AR, Pp + P + AR]
        else:
            masked = g.op("Add", g.op("Concat", s_resp, s_new, axis=-1), bias)  # [B, Hkv, g AR, P + AR]
            scores = g.op("Concat", s_prompt, masked, axis=-1)  # [B, Hkv, g AR, Pp + P + AR]
        probs = g.op("Softmax", scores, axis=-1)
        p_prompt, p_resp, p_new = g.op("Split", probs, self._sizes(), axis=-1, num_outputs=3)
        pp_heads = _split(self, p_prompt, hkv, axis=1)
        o_prompt = _cat(self, [g.op("MatMul", pp_heads[h], self._read(kv_name(Role.PROMPT_VALUE, layer, h)))
                               for h in range(hkv)], axis=1)  # [B, Hkv, g AR, D]
        o_resp = g.op("MatMul", p_resp, self._read(buffer_name(Role.PAST_VALUE, layer)))  # [B, Hkv, g AR, D]
        o = g.op("Add", g.op("Add", o_prompt, o_resp), g.op("MatMul", p_new, v))
        return self.linear(from_heads(self, o), f"l{layer}.o")

    def segment_attention(self, layer: int, x: str, *, rope: RopeTables) -> str:
        """staticlm's SegmentAttention: the prompt segment, the response rows and the new rows the bias lets each
        row see, in that order, each query row computed alone as the lane's CachedAttention computes it (gqa.py):
        a row gets the lane's bits."""
        g, c, s = self.g, self.c, self.s
        b, hkv, d = s.batch, c.num_kv_heads, c.head_dim
        q, k, v = rotated_qkv(self, layer, x, rope=rope)
        for t, role in ((k, Role.NEW_KEY), (v, Role.NEW_VALUE)):  # [B, AR, Hkv D] -> one [1, 1, AR, D] per slot
            heads = to_heads(self, t, num_heads=hkv)  # [B, Hkv, AR, D]
            rows = g.op("Reshape", self._stored(heads), g.const([b * hkv, 1, s.ar, d]))  # same bytes
            _split(self, rows, b * hkv, axis=0,
                   outputs=[kv_name(role, layer, h, seq) for seq in range(b) for h in range(hkv)])
        prompt = [kv_name(role, layer, h) for role in PROMPT_ROLES for h in range(hkv)]  # the keys, then the values
        out = g.op(attention_op("SegmentAttention", self.options.kv_dtype), q, k, v, Role.ATTENTION_BIAS.value,
                   buffer_name(Role.PAST_KEY, layer), buffer_name(Role.PAST_VALUE, layer), *prompt,
                   domain=KERNEL_DOMAIN, num_heads=c.num_heads, kv_num_heads=hkv, scale=c.attention_scale)
        return self.linear(out, f"l{layer}.o")  # [B, AR, H D]

    def _read(self, kv: str) -> str:
        """A KV input in float32: float16 KV (the prompt cache's type) is cast where the attention reads it."""
        return kv if self.options.kv_dtype == "float32" else self.g.op("Cast", kv, to=TensorProto.FLOAT)

    def _stored(self, rows: str) -> str:
        """New K/V rows in the cache's element type."""
        return rows if self.options.kv_dtype == "float32" else self.g.op("Cast", rows, to=TensorProto.FLOAT16)

    def build(self, name: str) -> onnx.ModelProto:
        g, c, s = self.g, self.c, self.s
        inputs, outputs = segment_graph_io(c, s, kv_dtype=self.options.kv_dtype)
        h = self.decoder(self.scale_embedding(self.embed(Role.INPUT_IDS.value)))  # [B, AR, hidden], final-normed
        h = g.op("Reshape", h, g.const([s.batch * s.ar, c.hidden_size]))
        g.op("Reshape", self.lm_head(h), g.const([s.batch, s.ar, c.vocab_size]), outputs=[Role.LOGITS.value])
        model = g.model(name=name, inputs=inputs, outputs=outputs,
                        doc=f"staticlm {name} (cpu, segment KV): B={s.batch}, AR={s.ar}")
        add_opsets(model)
        _make_segments_symbolic(model)
        return model


def _make_segments_symbolic(model: onnx.ModelProto) -> None:
    """Prompt inputs [prompt_len, D], response buffers [B, Hkv, past_len, D], bias [.., past_len_plus_ar] (a local
    layer's: [.., prompt_len_plus_past_len_plus_ar])."""
    prompt = tuple(f"{r.value}_" for r in PROMPT_ROLES)
    past = tuple(f"{r.value}_" for r in KV_INPUT_ROLES)
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith(prompt):
            dims[0].dim_param = PROMPT_DIM
        elif value.name.startswith(past):
            dims[2].dim_param = PAST_DIM
        elif value.name == Role.ATTENTION_BIAS.value:
            dims[3].dim_param = BIAS_DIM
        elif value.name == Role.ATTENTION_BIAS_LOCAL.value:
            dims[3].dim_param = LOCAL_BIAS_DIM


def segments_supported(config) -> bool:
    """Sliding-window layers keep masks of their own, which the segments do not model."""
    return not (config.sliding_window or getattr(config, "local_layers", ()))


def segment_shapes(shapes: list[tuple[str, GraphKind, GraphShape]]) -> list[tuple[str, GraphShape]]:
    """One segmented graph per batched (batch, AR) of the family, at its largest window."""
    largest: dict[tuple[int, int], GraphShape] = {}
    for _name, _kind, shape in shapes:
        key = (shape.batch, shape.ar)
        if shape.batch > 1 and (key not in largest or shape.past_len > largest[key].past_len):
            largest[key] = shape
    return [(f"segment_ar{ar}_b{b}", largest[(b, ar)]) for b, ar in sorted(largest)]


def export_segment_graphs(config, shapes: list[tuple[str, GraphKind, GraphShape]], *, work: Path, writer, cpu,
                          plans, on_step: Callable[[str], None] = lambda _name: None) -> list[GraphEntry]:
    """Build and save the segmented graphs; their manifest entries (empty when the family has no batched graphs
    or sliding-window layers, whose masks the segments do not model)."""
    if not segments_supported(config):
        return []
    entries = []
    for name, shape in segment_shapes(shapes):
        file = f"{name}.onnx"
        proto = SegmentCpuGraph(config, shape, weights=writer, options=cpu, plans=plans).build(name)
        onnx.save_model(proto, work / file)
        inputs, outputs = segment_graph_io(config, shape, kv_dtype=cpu.kv_dtype)
        entries.append(GraphEntry(name=name, file=file, kind=GraphKind.SEGMENT, shape=shape, inputs=inputs,
                                  outputs=outputs, sha256=file_sha256(work / file)))
        on_step(file)
    return entries

