"""Gemma 3's features as ModelConfig fields, from config.json or GGUF metadata: (1 + w) norms folded at load
(architectures.add_norm_offset), GELU-tanh MLP, sqrt(hidden) embedding scale, query_pre_attn_scalar, and local
sliding-window layers with their own RoPE base interleaved with global layers. Gemma 2's soft-capping is refused."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from staticlm.runtime.family.config import UnsupportedModel

from .architectures import Architecture
from .rope_scaling import base_inv_freq

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_DEFAULT_PATTERN = 6  # transformers' and llama.cpp's default: every sixth layer global
_LOCAL_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3


def refuse_softcapping(get) -> None:
    for option in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(option) is not None:
            raise UnsupportedModel(f"{option.replace('_', ' ')} (Gemma 2) is not supported")


def hf_features(cfg: dict[str, Any], arch: Architecture, *, hidden: int, head_dim: int) -> dict[str, Any]:
    """ModelConfig fields of config.json's Gemma 3 options ({} for other architectures, whose MLP must be SiLU)."""
    refuse_softcapping(cfg.get)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise UnsupportedModel(f"MLP activation {act!r} is not supported")
    if not arch.gemma:
        if act != "silu":
            raise UnsupportedModel(f"MLP activation {act!r} is not supported for {arch.name}")
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel("bidirectional attention (an embedding model) is not supported")
    num_layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or _DEFAULT_PATTERN)  # older configs: every pattern-th global
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)]
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = int(cfg.get("sliding_window") or 0)
    params = cfg.get("rope_parameters") or {}
    local_rope = params.get("sliding_attention") or {}
    if (local_rope.get("rope_type") or "default") != "default":
        raise UnsupportedModel(f"RoPE scaling {local_rope['rope_type']!r} on local layers is not supported")
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    return {
        "mlp_activation": _ACTIVATIONS[act], "sandwich_norms": True,
        "embedding_scale": embedding_scale(hidden, dtype=dtype),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or head_dim),
        "local_layers": local if window else (), "local_window": window if local else 0,
        "local_rope_theta": float(local_rope.get("rope_theta") or cfg.get("rope_local_base_freq") or _LOCAL_THETA),
    }


def hf_global_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The global layers' rope_parameters (Gemma 3 nests them per layer type; others are flat)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        return {**(cfg.get("rope_scaling") or {}), **params["full_attention"]}
    return {**(cfg.get("rope_scaling") or {}), **params}


def gguf_features(meta: dict[str, Any], *, key: str, hidden: int, heads: int, head_dim: int,
                  num_layers: int) -> dict[str, Any]:
    """Gemma 3's fields from GGUF metadata as llama.cpp reads them: the window from attention.sliding_window, every
    sixth layer global unless attention.sliding_window_pattern says otherwise, local RoPE base 10000 unless
    rope.freq_base_swa is given; softmax scale 1/sqrt(key_length) (the 27B's 62 layers: 1/sqrt(hidden/heads), its
    query_pre_attn_scalar) and embedding scale sqrt(hidden) in float32."""
    window = int(meta.get(f"{key}.attention.sliding_window") or 0)
    pattern = meta.get(f"{key}.attention.sliding_window_pattern", _DEFAULT_PATTERN)
    if isinstance(pattern, (list, tuple, np.ndarray)):
        local = tuple(i for i, is_local in enumerate(pattern) if is_local)
    else:
        local = tuple(i for i in range(num_layers) if (i + 1) % int(pattern))
    return {
        "mlp_activation": "gelu_tanh", "sandwich_norms": True, "embedding_scale": embedding_scale(hidden),
        "query_pre_attn_scalar": float(hidden // heads if num_layers == 62 else head_dim),
        "local_layers": local if window else (), "local_window": window if local else 0,
        "local_rope_theta": float(meta.get(f"{key}.rope.freq_base_swa", _LOCAL_THETA)),
    }


def embedding_scale(hidden: int, *, dtype: str = "float32") -> float:
    """sqrt(hidden) in the embedding's dtype, as transformers multiplies it (bfloat16: 8 significant bits)."""
    value = np.float32(math.sqrt(hidden))
    if dtype in ("bfloat16", "torch.bfloat16"):
        bits = value.view(np.uint32)
        value = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    elif dtype in ("float16", "torch.float16"):
        value = np.float32(np.float16(value))
    return float(value)


def linear_inv_freq(theta: float, dims: int, factor: float) -> tuple[float, ...]:
    """Linear RoPE scaling (Gemma 3 4B+ global layers): every frequency divided by factor."""
    return tuple(float(f) for f in base_inv_freq(theta, dims) / factor)
