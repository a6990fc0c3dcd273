"""The `--target cpu` decoder body on ORT's GroupQueryAttention, KV kept in place (KVLayout.IN_PLACE).

One fused node per layer does RoPE, the attention over every head group and the KV append:

- The packed QKV projection goes in as the op's `query` (no Split), rotated inside by the shared
  cos/sin tables at `position_ids` (absolute positions, so a slid cache keeps its positions).
- past_key_{l} and present_key_{l} are the same [B, Hkv, C, D] buffer of the kv_manager: the op writes the
  new rows at row `seqlens_k - query_seqlens + 1` and reads the real rows only. Nothing is copied, nothing is
  rebound per step, and the attention work follows the tokens actually cached, not a window length.
- `query_seqlens` right-pads a step (a prompt's last chunk, drafts shorter than the verify graph, idle
  sequences of a batch at 0): padding rows are neither appended nor attended to.

Compared with attention.py (windows over per-head tensors: ~20 nodes and 12 bindings per layer), this
is 30 GroupQueryAttention nodes instead of ~600 attention nodes for SmolLM2, and 60 bindings made once.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from staticlm.runtime.engine.rope import rope_cos_sin
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import Role, buffer_name
from staticlm.runtime.kernels import DOMAIN as KERNEL_DOMAIN

from .attention import CpuGraph, head_norm, projected_qkv

MS_DOMAIN = "com.microsoft"
ROPE_COS, ROPE_SIN = "rope_cos_half", "rope_sin_half"
LOCAL = "_local"  # suffix of the local layers' caches and row counts


def rope_suffix(kv_dtype: str) -> str:
    """The op's cos/sin caches have its compute type (the cache's): float16 tables are stored apart."""
    return "_f16" if kv_dtype == "float16" else ""


def rope_table_type(config: ModelConfig, options) -> tuple[str, np.dtype]:
    """The one form of the cos/sin tables the graph reads (name suffix, type): GroupQueryAttention's own RoPE in its
    cache's type (op_rotates), else RotaryEmbedding's (before GroupQueryAttention or staticlm's attention) in
    float32. options: the family's CpuOptions."""
    if op_rotates(config) and not options.staticlm_attention:
        return rope_suffix(options.kv_dtype), np.dtype(options.kv_dtype)
    return "", np.dtype(np.float32)


def rope_tables(config: ModelConfig, *, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_positions, R/2]: GroupQueryAttention's caches (HF's rotate_half pairs i and i + R/2 of the
    first R = rope_dims dims; longrope's attention factor included); local: the local layers' RoPE base."""
    cos, sin = rope_cos_sin(config, np.arange(config.max_positions), local=local)  # [max_positions, D]
    half = config.rope_dims // 2
    return cos[:, :half].astype(np.float32), sin[:, :half].astype(np.float32)


def attention(graph: CpuGraph, layer: int, x: str) -> str:
    """x [B, AR, hidden] (normed) -> the attention block's output [B, AR, hidden]."""
    if graph.options.staticlm_attention:
        return cached_attention(graph, layer, x)
    g, c = graph.g, graph.c
    # A local layer: its own RoPE caches and row counts (its buffers hold its newest rows only), and a window
    local = c.is_local(layer)
    suffix = LOCAL if local else ""
    # the op's own RoPE computes in its cache's type; RotaryEmbedding before it (op_rotates) in float32
    tables = suffix + rope_table_type(c, graph.options)[0]
    rope_cos, rope_sin = g.weight(ROPE_COS + tables), g.weight(ROPE_SIN + tables)
    window = {"local_window_size": c.local_window} if local else {}  # the keys a query sees, itself included
    qkv = graph.linear(x, f"l{layer}.qkv")  # [B, AR, (H + 2 Hkv) D]
    if c.attention_bias:
        qkv = g.op("Add", qkv, g.weight(f"l{layer}.qkv_bias"))
    qkv_inputs, inner_rope = [qkv, "", ""], op_rotates(c)
    if c.qk_norm or not inner_rope:  # q/k normed per head, then rotated, before the op (see op_rotates)
        hd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = g.op("Split", qkv, g.const([hd, kvd, kvd]), axis=-1, num_outputs=3)
        q = head_norm(graph, q, layer, "q", num_heads=c.num_heads)  # [B, AR, H D]
        k = head_norm(graph, k, layer, "k", num_heads=c.num_kv_heads)  # [B, AR, Hkv D]
        if not inner_rope:
            q, k = (g.op("RotaryEmbedding", t, Role.POSITION_IDS.value, rope_cos, rope_sin,
                         domain=MS_DOMAIN, num_heads=n, interleaved=0, rotary_embedding_dim=c.rope_dims)
                    for t, n in ((q, c.num_heads), (k, c.num_kv_heads)))
        qkv_inputs = [q, k, v]
    past_k, past_v = buffer_name(Role.PAST_KEY, layer), buffer_name(Role.PAST_VALUE, layer)
    half = graph.options.kv_dtype == "float16"  # the op computes in its cache's type: cast at its boundary only
    if half:
        qkv_inputs = [g.op("Cast", t, to=TensorProto.FLOAT16) if t else t for t in qkv_inputs]
    inputs = [*qkv_inputs, past_k, past_v, Role.SEQLENS_K.value + suffix, Role.TOTAL_LENGTH.value + suffix,
              rope_cos if inner_rope else "", rope_sin if inner_rope else "",
              Role.POSITION_IDS.value if inner_rope else "",
              "", "", "", "", "", "", Role.QUERY_LENGTHS.value]  # attention_bias .. k_norm_weight unused
    outputs = [f"l{layer}_attn", buffer_name(Role.PRESENT_KEY, layer), buffer_name(Role.PRESENT_VALUE, layer)]
    g.op("GroupQueryAttention", *inputs, domain=MS_DOMAIN, outputs=outputs, num_heads=c.num_heads,
         kv_num_heads=c.num_kv_heads, do_rotary=int(inner_rope), rotary_interleaved=0, scale=c.attention_scale,
         **window)
    out = g.op("Cast", outputs[0], to=TensorProto.FLOAT) if half else outputs[0]  # [B, AR, H D]
    return graph.linear(out, f"l{layer}.o")


def cached_attention(graph: CpuGraph, layer: int, x: str) -> str:
    """The same contract through staticlm's CachedAttention (runtime/kernels/attention_ops.c), which computes every
    query row alone: a row's bits do not depend on the rows beside it, and the segmented graphs' SegmentAttention
    gives it the same ones (segment_attention.py). RoPE runs before it, in float32, as there."""
    g, c = graph.g, graph.c
    local = c.is_local(layer)
    suffix = LOCAL if local else ""
    q, k, v = rotated_qkv(graph, layer, x, cos=g.weight(ROPE_COS + suffix), sin=g.weight(ROPE_SIN + suffix),
                          positions=Role.POSITION_IDS.value)
    outputs = [f"l{layer}_attn", buffer_name(Role.PRESENT_KEY, layer), buffer_name(Role.PRESENT_VALUE, layer)]
    g.op(attention_op("CachedAttention", graph.options.kv_dtype), q, k, v, buffer_name(Role.PAST_KEY, layer),
         buffer_name(Role.PAST_VALUE, layer), Role.SEQLENS_K.value + suffix, Role.QUERY_LENGTHS.value,
         domain=KERNEL_DOMAIN, outputs=outputs, num_heads=c.num_heads, kv_num_heads=c.num_kv_heads,
         scale=c.attention_scale, window=c.local_window if local else 0)
    return graph.linear(outputs[0], f"l{layer}.o")


def attention_op(name: str, kv_dtype: str) -> str:
    """staticlm's attention op for KV of kv_dtype"""
    return name + ("F16" if kv_dtype == "float16" else "")


def rotated_qkv(graph: CpuGraph, layer: int, x: str, *, cos: str, sin: str, positions: str
                ) -> tuple[str, str, str]:
    """x [B, AR, hidden] (normed) -> q [B, AR, H D], k and v [B, AR, Hkv D]: the projection, its biases, the q/k norms
    and RoPE (cos/sin caches [rows, R/2] read at positions [B, AR])."""
    g, c = graph.g, graph.c
    q, k, v = projected_qkv(graph, layer, x)  # [B, AR, H D], [B, AR, Hkv D] x 2
    q, k = (g.op("RotaryEmbedding", t, positions, cos, sin, domain=MS_DOMAIN, num_heads=n, interleaved=0,
                 rotary_embedding_dim=c.rope_dims) for t, n in ((q, c.num_heads), (k, c.num_kv_heads)))
    return q, k, v


def op_rotates(config: ModelConfig) -> bool:
    """Whether GroupQueryAttention's own RoPE can run: its cos cache width (R/2) must be a multiple of 8 (ORT).
    Otherwise (a small partial rotary) q and k go through RotaryEmbedding first. (A q/k norm is applied before the
    op too: the op's own q/k norm inputs are left unused.)"""
    return (config.rope_dims // 2) % 8 == 0
