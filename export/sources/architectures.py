"""Every architecture we export, declared once: what a decoder layer contains, as data.

The one graph builder (export/graph/llama.py and its target variants) reads the ModelConfig feature fields an
architecture sets (attention_bias, qk_norm, rotary_dim, the RoPE frequencies); sources read the names it
declares. Nothing else branches on an architecture's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from staticlm.runtime.family.config import ModelConfig

# llama.cpp tensor suffix -> HF module path inside model.layers.{i}, common to every architecture.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


@dataclass(frozen=True)
class Architecture:
    name: str  # ModelConfig.architecture
    hf_model_types: tuple[str, ...]  # config.json model_type values
    gguf_name: str  # general.architecture
    always_bias: bool = False  # q/k/v biases whatever config.json says (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    fused: bool = False  # the source carries qkv_proj and gate_up_proj (Phi-3): split at load
    gguf_qk_permuted: bool = False  # llama.cpp's converter permuted q/k rows for its RoPE kernel (llama only)
    gguf_layer_names: dict[str, str] = field(default_factory=dict)  # extra or replaced suffixes
    # Gemma: RMSNorm weights are stored as w and applied as (1 + w); loaded as 1 + w (llama.cpp's GGUF stores 1 + w)
    norm_offset: float = 0.0
    gemma: bool = False  # Gemma 3's features, read by export/sources/gemma.py into ModelConfig's fields
    tied_by_default: bool = False  # config.json without tie_word_embeddings ties the head (transformers' default)

    def gguf_hf_name(self, name: str) -> str | None:
        """A GGUF tensor name -> the HF name the source carries (fused for Phi-3); None for extras."""
        if name in _GGUF_GLOBAL_NAMES:
            return _GGUF_GLOBAL_NAMES[name]
        parts = name.split(".")
        layer_names = {**_GGUF_LAYER_NAMES, **self.gguf_layer_names}
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
            return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        return None


_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}

ARCHITECTURES = (
    Architecture("llama", ("llama", "mistral"), "llama", gguf_qk_permuted=True),
    Architecture("qwen2", ("qwen2",), "qwen2", always_bias=True),
    Architecture("qwen3", ("qwen3",), "qwen3", qk_norm=True,
                 gguf_layer_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}),
    Architecture("phi3", ("phi3",), "phi3", fused=True,
                 gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    # Gemma 3's text model: local sliding-window layers among global ones (export/sources/gemma.py reads them)
    Architecture("gemma3", ("gemma3_text",), "gemma3", qk_norm=True, norm_offset=1.0, gemma=True,
                 tied_by_default=True,
                 gguf_layer_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                                   "post_attention_norm": "post_attention_layernorm",
                                   "ffn_norm": "pre_feedforward_layernorm",
                                   "post_ffw_norm": "post_feedforward_layernorm"}),
)
BY_HF_TYPE = {t: a for a in ARCHITECTURES for t in a.hf_model_types}
BY_GGUF_NAME = {a.gguf_name: a for a in ARCHITECTURES}
BY_NAME = {a.name: a for a in ARCHITECTURES}
# Names users meet, refused with the reason (the rest: "not supported").
KNOWN_UNSUPPORTED = {"gemma2": "Gemma 2's attention/logit soft-capping",
                     "gemma3": "a vision tower: Gemma 3's multimodal checkpoint; its text model (gemma3_text) exports",
                     "clip": "a vision tower (mmproj)", "mamba": "a state-space model (Mamba)"}


def supported_names() -> str:
    return ", ".join(sorted(a.name for a in ARCHITECTURES))


def source_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a source of this config must carry, as it carries them (fused for Phi-3)."""
    arch = BY_NAME[config.architecture]
    c, d = config, config.head_dim
    q, kv, hidden, inter = c.num_heads * d, c.num_kv_heads * d, c.hidden_size, c.intermediate_size
    out = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, hidden)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        if arch.fused:
            out[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, hidden)
            out[p + "mlp.gate_up_proj.weight"] = (2 * inter, hidden)
        else:
            out.update({p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                        p + "self_attn.v_proj.weight": (kv, hidden), p + "mlp.gate_proj.weight": (inter, hidden),
                        p + "mlp.up_proj.weight": (inter, hidden)})
        out.update({p + "self_attn.o_proj.weight": (hidden, q), p + "mlp.down_proj.weight": (hidden, inter),
                    p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
        if c.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if c.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if c.sandwich_norms:
            out.update({p + "pre_feedforward_layernorm.weight": (hidden,),
                        p + "post_feedforward_layernorm.weight": (hidden,)})
    return out


def add_norm_offset(config: ModelConfig, weights: dict) -> None:
    """(1 + w) norms (Gemma) stored as w: every norm weight plus the architecture's offset, in place, in float32
    as transformers computes it (the GGUF converter stores the same sum)."""
    offset = BY_NAME[config.architecture].norm_offset
    if offset:
        for name in [n for n in weights if n.endswith("norm.weight")]:
            weights[name] = (weights[name].astype(np.float32) + np.float32(offset)).astype(np.float32)


def unfuse(config: ModelConfig, tensors: dict) -> None:
    """Split Phi-3's fused qkv_proj / gate_up_proj rows into q/k/v and gate/up, in place. Values are arrays or
    anything with `rows(indices)` (a source's exact weight grid); a no-op for unfused architectures."""
    if not BY_NAME[config.architecture].fused:
        return
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for fused, parts in ((p + "self_attn.qkv_proj.weight", [("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                                                                ("self_attn.v_proj", kv)]),
                             (p + "mlp.gate_up_proj.weight", [("mlp.gate_proj", inter), ("mlp.up_proj", inter)])):
            if fused not in tensors:
                continue
            value, start = tensors.pop(fused), 0
            for name, size in parts:
                tensors[f"{p}{name}.weight"] = _rows(value, start, start + size)
                start += size


def _rows(value, start: int, stop: int):
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value[start:stop])
    return value.rows(np.arange(start, stop))
