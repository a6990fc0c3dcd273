"""The `--target cpu` decoder body: ORT's fused CPU contrib ops and few nodes per layer.

At decode the CPU EP spends about as long dispatching a node as computing a small one, and every
parallel node wakes the intra-op pool, so the body is written for node count, not just arithmetic:

- RMSNorm and the residual add are one SkipSimplifiedLayerNormalization (its 4th output is the sum): the graph's
  add_norm (graph.py), plugged into the one decoder layer (export/graph/llama.py).
- RoPE is one RotaryEmbedding for all query heads and one for all KV heads. The engine's per-step
  rope_cos/rope_sin rows [B, 1, AR, D] become the op's "cache" ([B AR, D/2]: HF's rotate_half tables
  repeat one half) and position_ids are the constant row numbers, so the contract stays unchanged.
- Only the two matmuls that read a past window are per KV head (the past windows are separate tensors,
  bound in place; batching them would need a Concat, i.e. a copy of the cache). Everything else (new
  rows, softmax, bias) runs on all heads at once.
- AR=1 graphs skip every head Transpose: with one row the [AR, H, D] and [H, AR, D] orders are the same
  bytes, so a Reshape (no copy) does.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from staticlm.export.graph.builder import GraphBuilder
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import GraphShape, Role, kv_name

from .options import CpuOptions
from .rope import PositionRope


class CpuGraph(Protocol):
    """What the CPU bodies (this module, gqa.py, segment_attention.py) ask of the graph they build into
    (graph.py's CpuLlamaGraph, which imports them)."""

    g: GraphBuilder
    c: ModelConfig
    s: GraphShape
    options: CpuOptions

    def linear(self, x: str, weight: str) -> str: ...

    def rms_norm(self, x: str, weight: str) -> str: ...

    def split_probs(self, probs: str, layer: int = 0) -> list[str]: ...

    def position_rope(self, *, local: bool = False) -> PositionRope: ...

MS_DOMAIN = "com.microsoft"


class RopeTables:
    """Per-graph RoPE inputs shared by every layer: position_ids [B, AR], cos/sin caches [B AR, R/2] (R: the
    rotated dims, rope_dims; the rest of each head passes through)."""

    def __init__(self, graph: CpuGraph, *, local: bool = False) -> None:
        """local: from the local layers' rope_cos_local/rope_sin_local inputs."""
        g, s, d, r = graph.g, graph.s, graph.c.head_dim, graph.c.rope_dims
        rows = s.batch * s.ar
        self.position_ids = g.const(np.arange(rows).reshape(s.batch, s.ar))  # row r reads cache row r
        self.rotary_dim = r

        def half(name: str) -> str:  # [B, 1, AR, D] -> [B AR, R/2]: cos/sin repeat over the two halves
            flat = g.op("Reshape", name, g.const([rows, d]))
            return g.op("Slice", flat, g.const([0]), g.const([r // 2]), g.const([1]))

        cos, sin = (Role.ROPE_COS_LOCAL, Role.ROPE_SIN_LOCAL) if local else (Role.ROPE_COS, Role.ROPE_SIN)
        self.cos, self.sin = half(cos.value), half(sin.value)

    def apply(self, graph: CpuGraph, x: str, num_heads: int) -> str:
        """x [B, AR, n D] -> rotated [B, AR, n D]."""
        partial = {"rotary_embedding_dim": self.rotary_dim} if self.rotary_dim < graph.c.head_dim else {}
        return graph.g.op("RotaryEmbedding", x, self.position_ids, self.cos, self.sin, domain=MS_DOMAIN,
                          num_heads=num_heads, interleaved=0, **partial)


def head_norm(graph: CpuGraph, x: str, layer: int, kind: str, *, num_heads: int) -> str:
    """[B, AR, n D] -> the q or k norm (kind) over each head's D dims when the architecture has one, else x."""
    g, c = graph.g, graph.c
    if not c.qk_norm:
        return x
    x4 = g.op("Reshape", x, g.const([0, 0, num_heads, c.head_dim]))  # [B, AR, n, D]
    return g.op("Reshape", graph.rms_norm(x4, f"l{layer}.{kind}_norm"), g.const([0, 0, num_heads * c.head_dim]))


def grouped_bias(graph: CpuGraph, *, local: bool = False) -> str:
    """attention_bias [B, 1, AR, P+AR] -> [B, 1, g AR, P+AR], the row order of grouped queries (once per graph);
    local: attention_bias_local."""
    g, s, grp = graph.g, graph.s, graph.c.group_size
    bias = (Role.ATTENTION_BIAS_LOCAL if local else Role.ATTENTION_BIAS).value
    if s.ar == 1 or grp == 1:
        return bias  # one row broadcasts over the group
    return g.op("Tile", bias, g.const([1, 1, grp, 1]))  # the small mask, never KV


def to_heads(graph: CpuGraph, x: str, *, num_heads: int, group: int = 1) -> str:
    """[B, AR, n D] -> [B, n/group, group AR, D] (query heads of one KV head adjacent, rows inside)."""
    g, s, d = graph.g, graph.s, graph.c.head_dim
    kv_heads = num_heads // group
    if s.ar == 1:
        return g.op("Reshape", x, g.const([s.batch, kv_heads, group, d]))  # same bytes, no copy
    x5 = g.op("Reshape", x, g.const([s.batch, s.ar, kv_heads, group, d]))
    x5 = g.op("Transpose", x5, perm=[0, 2, 3, 1, 4])  # [B, Hkv, g, AR, D]
    return g.op("Reshape", x5, g.const([s.batch, kv_heads, group * s.ar, d]))


def from_heads(graph: CpuGraph, o: str) -> str:
    """[B, Hkv, g AR, D] -> [B, AR, H D] (inverse of to_heads for the query heads)."""
    g, s, c = graph.g, graph.s, graph.c
    if s.ar == 1:
        return g.op("Reshape", o, g.const([s.batch, 1, c.num_heads * c.head_dim]))
    o5 = g.op("Reshape", o, g.const([s.batch, c.num_kv_heads, c.group_size, s.ar, c.head_dim]))
    o5 = g.op("Transpose", o5, perm=[0, 3, 1, 2, 4])  # [B, AR, Hkv, g, D]
    return g.op("Reshape", o5, g.const([s.batch, s.ar, c.num_heads * c.head_dim]))


def _parts(graph: CpuGraph, x: str, n: int, axis: int) -> list[str]:
    return [x] if n == 1 else graph.g.op("Split", x, graph.g.const([1] * n), axis=axis, num_outputs=n)


def sequence_attention(graph: CpuGraph, layer: int, seq: int | None, *, q: str, k: str, v: str,
                       bias: str) -> str:
    """One sequence: q [1, Hkv, g AR, D], k/v [1, Hkv, AR, D], bias [1, 1, g AR, P+AR] -> [1, Hkv, g AR, D].

    Scores of the past windows (per head, the only reads of the cache) and of the new rows (all heads)
    are concatenated along the key axis: [g AR, P + AR] floats per head, never KV rows.
    """
    g, hkv = graph.g, graph.c.num_kv_heads
    g.op("Split", k, g.const([1] * hkv), axis=1, outputs=[kv_name(Role.NEW_KEY, layer, h, seq) for h in range(hkv)])
    g.op("Split", v, g.const([1] * hkv), axis=1,
         outputs=[kv_name(Role.NEW_VALUE, layer, h, seq) for h in range(hkv)])
    q_parts = _parts(graph, q, hkv, axis=1)
    # FusedMatMul transB reads the [P, D] window as K^T in place (no Transpose node, no copy).
    s_past = [g.op("FusedMatMul", q_parts[h], kv_name(Role.PAST_KEY, layer, h, seq), domain=MS_DOMAIN,
                   transB=1, alpha=graph.c.attention_scale) for h in range(hkv)]  # each [1, 1, g AR, P]
    s_new = g.op("FusedMatMul", q, k, domain=MS_DOMAIN, transB=1,
                 alpha=graph.c.attention_scale)  # [1, Hkv, g AR, AR]
    scores = g.op("Concat", *s_past, s_new, axis=-1) if hkv == 1 else \
        g.op("Concat", g.op("Concat", *s_past, axis=1), s_new, axis=-1)  # [1, Hkv, g AR, P + AR]
    probs = g.op("Softmax", g.op("Add", scores, bias), axis=-1)
    p_past, p_new = graph.split_probs(probs, layer)  # [1, Hkv, g AR, P], [1, Hkv, g AR, AR]
    p_parts = _parts(graph, p_past, hkv, axis=1)
    o_past = [g.op("MatMul", p_parts[h], kv_name(Role.PAST_VALUE, layer, h, seq)) for h in range(hkv)]
    o_past = o_past[0] if hkv == 1 else g.op("Concat", *o_past, axis=1)  # [1, Hkv, g AR, D]
    return g.op("Add", o_past, g.op("MatMul", p_new, v))


def projected_qkv(graph: CpuGraph, layer: int, x: str) -> tuple[str, str, str]:
    """x [B, AR, hidden] (normed) -> q [B, AR, H D], k and v [B, AR, Hkv D]: the projection, its biases and the
    q/k norms (not rotated)."""
    g, c = graph.g, graph.c
    hd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = graph.linear(x, f"l{layer}.qkv")  # [B, AR, (H + 2 Hkv) D]
    if c.attention_bias:
        qkv = g.op("Add", qkv, g.weight(f"l{layer}.qkv_bias"))
    q, k, v = g.op("Split", qkv, g.const([hd, kvd, kvd]), axis=-1, num_outputs=3)
    q = head_norm(graph, q, layer, "q", num_heads=c.num_heads)
    return q, head_norm(graph, k, layer, "k", num_heads=c.num_kv_heads), v


def qkv_heads(graph: CpuGraph, layer: int, x: str, *, rope: RopeTables) -> tuple[str, str, str]:
    """x [B, AR, hidden] (normed) -> q [B, Hkv, g AR, D], k and v [B, Hkv, AR, D]: the projection, its biases,
    the q/k norms and RoPE."""
    c = graph.c
    q, k, v = projected_qkv(graph, layer, x)
    q = to_heads(graph, rope.apply(graph, q, c.num_heads), num_heads=c.num_heads, group=c.group_size)
    k = to_heads(graph, rope.apply(graph, k, c.num_kv_heads), num_heads=c.num_kv_heads)
    return q, k, to_heads(graph, v, num_heads=c.num_kv_heads)


def attention(graph: CpuGraph, layer: int, x: str, *, rope: RopeTables, bias: str) -> str:
    """x [B, AR, hidden] (normed) -> the attention block's output [B, AR, hidden]."""
    g, s = graph.g, graph.s
    q, k, v = qkv_heads(graph, layer, x, rope=rope)
    if s.batch == 1:
        o = sequence_attention(graph, layer, None, q=q, k=k, v=v, bias=bias)
    else:  # each sequence attends over its own windows (its own KV inputs)
        parts = [g.op("Split", t, g.const([1] * s.batch), axis=0, num_outputs=s.batch) for t in (q, k, v, bias)]
        o = g.op("Concat", *[sequence_attention(graph, layer, b, q=parts[0][b], k=parts[1][b], v=parts[2][b],
                                                bias=parts[3][b]) for b in range(s.batch)], axis=0)
    return graph.linear(from_heads(graph, o), f"l{layer}.o")
