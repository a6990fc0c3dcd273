"""The `--target cpu` decoder body on ORT's GroupQueryAttention, KV kept in place (KVLayout.IN_PLACE).

One fused node per layer does the attention over every head group and the KV append:

- q and k are rotated before it by RotaryEmbedding, at `position_ids` (absolute positions, so a slid cache keeps
  its positions), with cos/sin of the step's rows computed in the graph (rope.py): the op's own RoPE would read a
  table of every position, which would be stored beside the weights.
- past_key_{l} and present_key_{l} are the same [B, Hkv, C, D] buffer of the kv_manager: the op writes the
  new rows at row `seqlens_k - query_seqlens + 1` and reads the real rows only. Nothing is copied, nothing is
  rebound per step, and the attention work follows the tokens actually cached, not a window length.
- `query_seqlens` right-pads a step (a prompt's last chunk, drafts shorter than the verify graph, idle
  sequences of a batch at 0): padding rows are neither appended nor attended to.

Compared with attention.py (windows over per-head tensors: ~20 nodes and 12 bindings per layer), this
is 30 GroupQueryAttention nodes instead of ~600 attention nodes for SmolLM2, and 60 bindings made once.
"""
from __future__ import annotations

from onnx import TensorProto

from staticlm.runtime.family.contract import Role, buffer_name
from staticlm.runtime.kernels import DOMAIN as KERNEL_DOMAIN

from .attention import CpuGraph, RopeTables, projected_qkv
from .rope import LOCAL, PositionRope

MS_DOMAIN = "com.microsoft"


def attention(graph: CpuGraph, layer: int, x: str) -> str:
    """x [B, AR, hidden] (normed) -> the attention block's output [B, AR, hidden]."""
    if graph.options.staticlm_attention:
        return cached_attention(graph, layer, x)
    g, c = graph.g, graph.c
    # A local layer: its own RoPE and row counts (its buffers hold its newest rows only), and a window
    local = c.is_local(layer)
    suffix = LOCAL if local else ""
    window = {"local_window_size": c.local_window} if local else {}  # the keys a query sees, itself included
    qkv = list(rotated_qkv(graph, layer, x, rope=graph.position_rope(local=local)))  # [B, AR, H D], [B, AR, Hkv D] x 2
    past_k, past_v = buffer_name(Role.PAST_KEY, layer), buffer_name(Role.PAST_VALUE, layer)
    half = graph.options.kv_dtype == "float16"  # the op computes in its cache's type: cast at its boundary only
    if half:
        qkv = [g.op("Cast", t, to=TensorProto.FLOAT16) for t in qkv]
    inputs = [*qkv, past_k, past_v, Role.SEQLENS_K.value + suffix, Role.TOTAL_LENGTH.value + suffix,
              "", "", "", "", "", "", "", "", "", Role.QUERY_LENGTHS.value]  # cos_cache .. k_norm_weight unused
    outputs = [f"l{layer}_attn", buffer_name(Role.PRESENT_KEY, layer), buffer_name(Role.PRESENT_VALUE, layer)]
    g.op("GroupQueryAttention", *inputs, domain=MS_DOMAIN, outputs=outputs, num_heads=c.num_heads,
         kv_num_heads=c.num_kv_heads, do_rotary=0, scale=c.attention_scale, **window)
    out = g.op("Cast", outputs[0], to=TensorProto.FLOAT) if half else outputs[0]  # [B, AR, H D]
    return graph.linear(out, f"l{layer}.o")


def cached_attention(graph: CpuGraph, layer: int, x: str) -> str:
    """The same contract through staticlm's CachedAttention (runtime/kernels/attention_ops.c), which computes every
    query row alone: a row's bits do not depend on the rows beside it, and the segmented graphs' SegmentAttention
    gives it the same ones (segment_attention.py). RoPE runs before it, in float32, as there."""
    g, c = graph.g, graph.c
    local = c.is_local(layer)
    q, k, v = rotated_qkv(graph, layer, x, rope=graph.position_rope(local=local))
    outputs = [f"l{layer}_attn", buffer_name(Role.PRESENT_KEY, layer), buffer_name(Role.PRESENT_VALUE, layer)]
    g.op(attention_op("CachedAttention", graph.options.kv_dtype), q, k, v, buffer_name(Role.PAST_KEY, layer),
         buffer_name(Role.PAST_VALUE, layer), Role.SEQLENS_K.value + (LOCAL if local else ""),
         Role.QUERY_LENGTHS.value, domain=KERNEL_DOMAIN, outputs=outputs, num_heads=c.num_heads,
         kv_num_heads=c.num_kv_heads, scale=c.attention_scale, window=c.local_window if local else 0)
    return graph.linear(outputs[0], f"l{layer}.o")


def attention_op(name: str, kv_dtype: str) -> str:
    """staticlm's attention op for KV of kv_dtype"""
    return name + ("F16" if kv_dtype == "float16" else "")


def rotated_qkv(graph: CpuGraph, layer: int, x: str, *, rope: PositionRope | RopeTables) -> tuple[str, str, str]:
    """x [B, AR, hidden] (normed) -> q [B, AR, H D], k and v [B, AR, Hkv D]: the projection, its biases, the q/k norms
    and RoPE (rope: cos/sin [rows, R/2] and the row each token reads, position_ids [B, AR])."""
    g, c = graph.g, graph.c
    q, k, v = projected_qkv(graph, layer, x)  # [B, AR, H D], [B, AR, Hkv D] x 2
    q, k = (g.op("RotaryEmbedding", t, rope.position_ids, rope.cos, rope.sin, domain=MS_DOMAIN, num_heads=n,
                 interleaved=0, rotary_embedding_dim=c.rope_dims) for t, n in ((q, c.num_heads), (k, c.num_kv_heads)))
    return q, k, v
