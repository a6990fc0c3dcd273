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

from typing import TYPE_CHECKING

import numpy as np

from staticlm.runtime.family.contract import Role, buffer_name

from .attention import _skip_norm, mlp

if TYPE_CHECKING:
    from .graph import CpuLlamaGraph

MS_DOMAIN = "com.microsoft"
ROPE_COS, ROPE_SIN = "rope_cos_half", "rope_sin_half"


def rope_tables(*, head_dim: int, theta: float, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_positions, D/2]: GroupQueryAttention's caches (HF's rotate_half pairs i and i + D/2)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def attention(graph: CpuLlamaGraph, layer: int, x: str) -> str:
    """x [B, AR, hidden] (normed) -> the attention block's output [B, AR, hidden]."""
    g, c = graph.g, graph.c
    qkv = graph.linear(x, f"l{layer}.qkv")  # [B, AR, (H + 2 Hkv) D]; 1/sqrt(D) is folded into Wq
    if c.attention_bias:
        qkv = g.op("Add", qkv, g.weight(f"l{layer}.qkv_bias"))
    past_k, past_v = buffer_name(Role.PAST_KEY, layer), buffer_name(Role.PAST_VALUE, layer)
    inputs = [qkv, "", "", past_k, past_v, Role.SEQLENS_K.value, Role.TOTAL_LENGTH.value,
              g.weight(ROPE_COS), g.weight(ROPE_SIN), Role.POSITION_IDS.value,
              "", "", "", "", "", "", Role.QUERY_LENGTHS.value]  # attention_bias .. k_norm_weight unused
    outputs = [f"l{layer}_attn", buffer_name(Role.PRESENT_KEY, layer), buffer_name(Role.PRESENT_VALUE, layer)]
    g.op("GroupQueryAttention", *inputs, domain=MS_DOMAIN, outputs=outputs, num_heads=c.num_heads,
         kv_num_heads=c.num_kv_heads, do_rotary=1, rotary_interleaved=0, scale=1.0)
    return graph.linear(outputs[0], f"l{layer}.o")


def decoder(graph: CpuLlamaGraph, h: str) -> str:
    """Embedded rows [B, AR, hidden] -> final-normed rows [B, AR, hidden] (residuals as in attention.py)."""
    g, c = graph.g, graph.c
    x = g.op("SimplifiedLayerNormalization", h, g.weight("l0.attn_norm"), axis=-1, epsilon=float(c.rms_norm_eps))
    for layer in range(c.num_layers):
        x, h = _skip_norm(graph, attention(graph, layer, x), h, f"l{layer}.mlp_norm", tag=f"l{layer}_mlp")
        nxt = f"l{layer + 1}.attn_norm" if layer + 1 < c.num_layers else "final_norm"
        x, h = _skip_norm(graph, mlp(graph, layer, x), h, nxt, tag=f"l{layer}_out")
    return x
