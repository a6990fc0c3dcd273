"""The Llama decoder as one static-shape ONNX graph per (AR, P).

Attention never concatenates KV: the past window and the AR new rows are scored
separately and their probabilities split again, so the only tensors the graph
copies are [B, g, AR, P] scores, never the [P, D] cache. GQA groups query heads
over one KV head by broadcasting (no Tile/repeat of KV).
"""
from __future__ import annotations

import numpy as np

from staticlm.export.weight_file import WeightFileWriter
from staticlm.runtime.family.config import ModelConfig
from staticlm.runtime.family.contract import GraphShape, Role, graph_io, kv_name

from .builder import GraphBuilder


def attention_weights(config: ModelConfig, hf: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """One layer's attention tensors in HF [out, in] layout, float32: q, k, v (+ q_bias, k_bias, v_bias,
    q_norm, k_norm as the config declares them).

    The softmax scale (config.attention_scale) is folded in here, the one place: into the q norm's weight when
    the architecture norms q (a norm would undo a scale folded before it), else into Wq and its bias. Both
    commute with RoPE, which is linear."""
    p, f32, scale = f"model.layers.{layer}.self_attn.", np.float32, config.attention_scale
    out = {x: hf[p + f"{x}_proj.weight"].astype(f32) for x in "qkv"}
    if config.attention_bias:
        out.update({f"{x}_bias": hf[p + f"{x}_proj.bias"].astype(f32) for x in "qkv"})
    if config.qk_norm:
        out["q_norm"] = (hf[p + "q_norm.weight"] * scale).astype(f32)  # [D]
        out["k_norm"] = hf[p + "k_norm.weight"].astype(f32)  # [D]
    else:
        out["q"] = (out["q"] * scale).astype(f32)
        if config.attention_bias:
            out["q_bias"] = (out["q_bias"] * scale).astype(f32)
    return out


def layer_norms(config: ModelConfig, layer: int) -> dict[str, str]:
    """A layer's RMSNorm weights: graph name -> HF name. With sandwich norms (Gemma 3) the MLP's input norm is
    pre_feedforward_layernorm and post_attention_layernorm is the attention output's norm; else (Llama)
    post_attention_layernorm is the MLP's input norm."""
    p = f"model.layers.{layer}."
    if not config.sandwich_norms:
        return {f"l{layer}.attn_norm": p + "input_layernorm.weight",
                f"l{layer}.mlp_norm": p + "post_attention_layernorm.weight"}
    return {f"l{layer}.attn_norm": p + "input_layernorm.weight", f"l{layer}.attn_post_norm": p +
            "post_attention_layernorm.weight", f"l{layer}.mlp_norm": p + "pre_feedforward_layernorm.weight",
            f"l{layer}.mlp_post_norm": p + "post_feedforward_layernorm.weight"}


def write_weights(config: ModelConfig, hf: dict[str, np.ndarray], writer: WeightFileWriter) -> None:
    """Lay out HF-named float weights the way the graph consumes them ([in, out], fused)."""
    f32 = np.float32
    writer.add("embed", hf["model.embed_tokens.weight"].astype(f32))  # [V, hidden]
    writer.add("final_norm", hf["model.norm.weight"].astype(f32))
    if not config.tie_word_embeddings:
        writer.add("lm_head", hf["lm_head.weight"].astype(f32))  # [V, hidden], used with transB
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        a = attention_weights(config, hf, layer)
        for name, hf_name in layer_norms(config, layer).items():
            writer.add(name, hf[hf_name].astype(f32))
        writer.add(f"l{layer}.qkv", np.concatenate([a["q"], a["k"], a["v"]]).T.astype(f32))  # [hidden, (H + 2 Hkv) D]
        if config.attention_bias:
            writer.add(f"l{layer}.qkv_bias", np.concatenate([a["q_bias"], a["k_bias"], a["v_bias"]]).astype(f32))
        if config.qk_norm:
            writer.add(f"l{layer}.q_norm", a["q_norm"])  # [D]
            writer.add(f"l{layer}.k_norm", a["k_norm"])  # [D]
        writer.add(f"l{layer}.o", hf[p + "self_attn.o_proj.weight"].T.astype(f32))  # [H D, hidden]
        gate_up = np.concatenate([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        writer.add(f"l{layer}.gate_up", gate_up.T.astype(f32))  # [hidden, 2 I]
        writer.add(f"l{layer}.down", hf[p + "mlp.down_proj.weight"].T.astype(f32))  # [I, hidden]


class LlamaGraph:
    """Builds one family member; all members reference the same weight tensors.

    The decoder layer is written once (`decoder`), for every graph kind: the float graphs here, the HTP style
    (htp_style.py), the CPU target (export/cpu/graph.py) and the segmented graphs of both targets. What a target
    changes plugs in: the attention body (`layer_attention`), the norms (`rms_norm`, and `add_norm`, the residual
    add and the next norm, which the CPU target fuses into one node) and the MLP gate's `activation`.
    """

    def __init__(self, config: ModelConfig, shape: GraphShape, *, weights: WeightFileWriter) -> None:
        self.c, self.s = config, shape
        self.g = GraphBuilder(weights=weights)

    def rms_norm(self, x: str, weight: str) -> str:
        # The Pow/ReduceMean/Sqrt/Div pattern is what ORT fuses into SimplifiedLayerNormalization.
        g = self.g
        var = g.op("ReduceMean", g.op("Pow", x, g.const(2.0, np.float32)), axes=[-1], keepdims=1)
        rstd = g.op("Div", g.const(1.0, np.float32),
                    g.op("Sqrt", g.op("Add", var, g.const(self.c.rms_norm_eps, np.float32))))
        return g.op("Mul", g.op("Mul", x, rstd), g.weight(weight))

    def rope(self, x: str, cos: str, sin: str, *, out: str | None = None) -> str:
        """x [.., D] rotated by cos/sin [.., D] (rotate_half over the first rope_dims dims; the rest pass through,
        the tables holding 1 and 0 there); out names the result."""
        g, c = self.g, self.c
        half, rest = c.rope_dims // 2, c.head_dim - c.rope_dims
        sizes = [half, half] + ([rest] if rest else [])
        parts = g.op("Split", x, g.const(sizes), axis=-1, num_outputs=len(sizes))
        rotated = g.op("Concat", g.op("Neg", parts[1]), parts[0], *parts[2:], axis=-1)
        y = g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin), **({"outputs": [out]} if out else {}))
        return out or y

    def head_norm(self, x: str, layer: int, kind: str) -> str:
        """[.., D] -> the q or k norm (kind) over head_dim when the architecture has one, else x."""
        return self.rms_norm(x, f"l{layer}.{kind}_norm") if self.c.qk_norm else x

    def heads(self, x: str, num_heads: int, *, norm: tuple[int, str] | None = None) -> str:
        """[B, AR, n D] -> [B, n, AR, D]; norm (layer, "q" | "k"): the head norm, applied in the [B, AR, n, D]
        order (on HTP a norm after the Transpose loses precision: see tests/test_architectures.py)."""
        g, s = self.g, self.s
        x4 = g.op("Reshape", x, g.const([s.batch, s.ar, num_heads, self.c.head_dim]))  # [B, AR, n, D]
        if norm is not None:
            x4 = self.head_norm(x4, *norm)
        return g.op("Transpose", x4, perm=[0, 2, 1, 3])

    def attention(self, layer: int, x: str, cos: str, sin: str, bias: str) -> str:
        g, c, s = self.g, self.c, self.s
        hd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = self.linear(x, f"l{layer}.qkv")  # [B, AR, (H + 2 Hkv) D]
        if c.attention_bias:
            qkv = g.op("Add", qkv, g.weight(f"l{layer}.qkv_bias"))
        q, k, v = g.op("Split", qkv, g.const([hd, kvd, kvd]), axis=-1, num_outputs=3)
        q = self.rope(self.heads(q, c.num_heads, norm=(layer, "q")), cos, sin)  # [B, H, AR, D]
        k = self.rope(self.heads(k, c.num_kv_heads, norm=(layer, "k")), cos, sin)  # [B, Hkv, AR, D]
        v = self.heads(v, c.num_kv_heads)
        if s.batch == 1:
            o = self.sequence_attention(layer, None, q, k, v, bias)
        else:  # each sequence attends over its own window (its own KV inputs); the matmuls above stay batched
            parts = [g.op("Split", t, g.const([1] * s.batch), axis=0, num_outputs=s.batch) for t in (q, k, v, bias)]
            o = g.op("Concat", *[self.sequence_attention(layer, b, *(p[b] for p in parts))
                                 for b in range(s.batch)], axis=0)  # [B, H, AR, D]
        o = g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), g.const([s.batch, s.ar, hd]))
        return self.linear(o, f"l{layer}.o")

    def linear(self, x: str, weight: str) -> str:
        """x @ W for an [in, out] weight; the CPU target swaps in MatMulNBits (export/cpu/graph.py)."""
        return self.g.op("MatMul", x, self.g.weight(weight))

    def split_probs(self, probs: str, layer: int = 0) -> list[str]:
        """[.., P + AR] -> the past part [.., P] and the new part [.., AR] (a local layer's P: min(P, W-1))."""
        past_len = self.c.layer_past_len(layer, self.s.past_len)
        return self.g.op("Split", probs, self.g.const([past_len, self.s.ar]), axis=-1, num_outputs=2)

    def sequence_attention(self, layer: int, seq: int | None, q: str, k: str, v: str, bias: str) -> str:
        """One sequence: q [1, H, AR, D], k/v [1, Hkv, AR, D], bias [1, 1, AR, P+AR] -> [1, H, AR, D]."""
        g, c = self.g, self.c
        hkv = c.num_kv_heads
        new_k = [kv_name(Role.NEW_KEY, layer, h, seq) for h in range(hkv)]
        new_v = [kv_name(Role.NEW_VALUE, layer, h, seq) for h in range(hkv)]
        g.op("Split", k, g.const([1] * hkv), axis=1, outputs=new_k)  # each [1, 1, AR, D]
        g.op("Split", v, g.const([1] * hkv), axis=1, outputs=new_v)
        q_groups = [q] if hkv == 1 else g.op("Split", q, g.const([c.group_size] * hkv), axis=1, num_outputs=hkv)
        outs = []
        for h in range(hkv):  # builds per-KV-head attention; not a runtime loop
            qh = q_groups[h]  # [1, g, AR, D]
            past_k, past_v = kv_name(Role.PAST_KEY, layer, h, seq), kv_name(Role.PAST_VALUE, layer, h, seq)
            s_past = g.op("MatMul", qh, g.op("Transpose", past_k, perm=[0, 1, 3, 2]))  # [1, g, AR, P]
            s_new = g.op("MatMul", qh, g.op("Transpose", new_k[h], perm=[0, 1, 3, 2]))  # [1, g, AR, AR]
            scores = g.op("Add", g.op("Concat", s_past, s_new, axis=-1), bias)  # [1, g, AR, P + AR]
            probs = g.op("Softmax", scores, axis=-1)
            p_past, p_new = self.split_probs(probs, layer)
            outs.append(g.op("Add", g.op("MatMul", p_past, past_v), g.op("MatMul", p_new, new_v[h])))
        return outs[0] if hkv == 1 else g.op("Concat", *outs, axis=1)  # [1, H, AR, D]

    def mlp(self, layer: int, x: str) -> str:
        g, i = self.g, self.c.intermediate_size
        gate, up = g.op("Split", self.linear(x, f"l{layer}.gate_up"), g.const([i, i]),
                        axis=-1, num_outputs=2)
        return self.linear(g.op("Mul", self.activation(gate), up), f"l{layer}.down")

    def activation(self, x: str) -> str:
        """The MLP gate's activation: SiLU x sigmoid(x), or GELU's tanh approximation (Gemma: gelu_pytorch_tanh)
        0.5 x (1 + tanh(z)) = x sigmoid(2 z), z = sqrt(2/pi) (x + 0.044715 x^3): the sigmoid form is SiLU's
        nodes (one Sigmoid, which HTP runs as it runs SiLU's) plus the cubic."""
        g = self.g
        if self.c.mlp_activation == "silu":
            return g.op("Mul", x, g.op("Sigmoid", x))
        cubic = g.op("Mul", g.op("Mul", x, x), g.const(0.044715, np.float32))  # 0.044715 x^2
        z2 = g.op("Mul", g.op("Mul", x, g.op("Add", cubic, g.const(1.0, np.float32))),
                  g.const(float(2.0 * np.sqrt(2.0 / np.pi)), np.float32))  # 2 z
        return g.op("Mul", x, g.op("Sigmoid", z2))

    def layer_inputs(self, layer: int) -> tuple[str, str, str]:
        """The RoPE rows and mask a layer reads: a local layer's own, else the global ones."""
        if self.c.is_local(layer):
            return Role.ROPE_COS_LOCAL.value, Role.ROPE_SIN_LOCAL.value, Role.ATTENTION_BIAS_LOCAL.value
        return Role.ROPE_COS.value, Role.ROPE_SIN.value, Role.ATTENTION_BIAS.value

    def post_norm(self, x: str, layer: int, kind: str) -> str:
        """Sandwich norms (Gemma 3): the attention's or MLP's output normed before its residual add."""
        return self.rms_norm(x, f"l{layer}.{kind}_post_norm") if self.c.sandwich_norms else x

    def scale_embedding(self, h: str) -> str:
        """Gemma: the embedded rows times sqrt(hidden) (ModelConfig.embedding_scale)."""
        if self.c.embedding_scale == 1.0:
            return h
        return self.g.op("Mul", h, self.g.const(self.c.embedding_scale, np.float32))

    def decoder(self, h: str) -> str:
        """Embedded rows [B, AR, hidden] -> the final-normed rows [B, AR, hidden]: every layer, pre-norm residual
        blocks, with Gemma 3's sandwich norms (post_norm) where the architecture has them."""
        num_layers = self.c.num_layers
        x = self.rms_norm(h, "l0.attn_norm")
        for layer in range(num_layers):
            a = self.post_norm(self.layer_attention(layer, x), layer, "attn")
            x, h = self.add_norm(a, h, f"l{layer}.mlp_norm", tag=f"l{layer}_mlp")
            m = self.post_norm(self.mlp(layer, x), layer, "mlp")
            following = f"l{layer + 1}.attn_norm" if layer + 1 < num_layers else "final_norm"
            x, h = self.add_norm(m, h, following, tag=f"l{layer}_out")  # export/parts.py cuts at l{L}_out_residual
        return x

    def add_norm(self, x: str, residual: str, weight: str, *, tag: str) -> tuple[str, str]:
        """(the norm of residual + x, residual + x), the sum named {tag}_residual."""
        total = self.g.op("Add", residual, x, outputs=[f"{tag}_residual"])[0]
        return self.rms_norm(total, weight), total

    def layer_attention(self, layer: int, x: str) -> str:
        """x [B, AR, hidden] (normed) -> the attention block's output [B, AR, hidden], with the layer's own RoPE
        rows and mask (a local layer's)."""
        return self.attention(layer, x, *self.layer_inputs(layer))

    def build(self, name: str):
        g, c, s = self.g, self.c, self.s
        inputs, outputs = graph_io(c, s)
        h = self.decoder(self.scale_embedding(self.embed("input_ids")))  # [B, AR, hidden]
        h = g.op("Reshape", h, g.const([s.batch * s.ar, c.hidden_size]))
        logits = self.lm_head(h)  # [B AR, V]
        g.op("Reshape", logits, g.const([s.batch, s.ar, c.vocab_size]), outputs=["logits"])
        return g.model(name=name, inputs=inputs, outputs=outputs,
                       doc=f"staticlm {name}: AR={s.ar}, P={s.past_len}, S={s.context}")

    def embed(self, ids: str) -> str:
        return self.g.op("Gather", self.g.weight("embed"), ids, axis=0)

    def lm_head(self, h: str) -> str:
        """[N, hidden] -> [N, V]; the tied head reuses the embedding table, no copy."""
        head = self.g.weight("embed" if self.c.tie_word_embeddings else "lm_head")
        return self.g.op("Gemm", h, head, transB=1)
