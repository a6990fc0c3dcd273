"""Load a Llama-architecture GGUF file (llama.cpp layout) into HF-named float32 weights."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from staticlm.runtime.family.config import ModelConfig, UnsupportedModel

from .gguf_file import GGUFFile
from .gguf_tokenizer import build_tokenizer
from .model import LoadedModel, ModelSourceError, UnsupportedSource, required_weight_names

# llama.cpp tensor suffix -> HF module path inside model.layers.{i}.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_SUPPORTED_ARCHS = ("llama",)


def load_gguf(path: Path, *, source: str | None = None) -> LoadedModel:
    gf = GGUFFile(path)
    meta = gf.metadata
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise UnsupportedSource(f"{path.name}: GGUF architecture {arch!r} is not supported (only 'llama')")
    try:
        config = _config(meta, gf, arch=arch)
    except UnsupportedModel as exc:
        raise UnsupportedSource(f"{path.name}: {exc}") from None
    tokenizer = build_tokenizer(meta, name=path.name)
    weights = _weights(gf, config)
    return LoadedModel(
        config=config, weights=weights, tokenizer_json=tokenizer.tokenizer_json,
        chat_template=tokenizer.chat_template, bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
        add_bos_token=tokenizer.add_bos_token, source=source or f"GGUF {path}",
    )


def _config(meta: dict[str, Any], gf: GGUFFile, *, arch: str) -> ModelConfig:
    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelSourceError(f"{gf.path.name}: GGUF metadata lacks {full}")
        return meta[full]

    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModel(f"RoPE scaling {scaling!r} is not supported")
    if "token_embd.weight" not in gf.tensors:
        raise ModelSourceError(f"{gf.path.name}: GGUF has no token_embd.weight tensor")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedModel(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    return ModelConfig(
        architecture="llama",
        num_layers=int(need("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(need("feed_forward_length")),
        # The embedding's rows are what the graph indexes; the token list may be padded or short.
        vocab_size=gf.tensors["token_embd.weight"].shape[0],
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        max_positions=int(need("context_length")),
        tie_word_embeddings="output.weight" not in gf.tensors,  # llama.cpp omits output when tied
        attention_bias=False,
    )


def _weights(gf: GGUFFile, config: ModelConfig) -> dict[str, np.ndarray]:
    weights: dict[str, np.ndarray] = {}
    for name in gf.tensors:
        hf = _hf_name(name)
        if hf is None:
            continue  # e.g. rope_freqs: llama.cpp extras the graph does not use
        w = gf.tensor(name)
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, config.num_heads)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, config.num_kv_heads)
        weights[hf] = w
    missing = [n for n in required_weight_names(config) if n not in weights]
    if missing:
        raise ModelSourceError(f"{gf.path.name}: missing tensor for {missing[0]} ({len(missing)} missing)")
    return weights


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf `permute`), as transformers does.

    llama.cpp interleaves the two rotary halves of each head ([x0, x_{d/2}, x1, ...]) for its
    RoPE kernel; HF's rotate_half wants them as two contiguous halves.
    """
    dim1 = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_head, dim1 // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape))


def _f32(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999975e-06. Keep its shortest float32 spelling."""
    return float(str(np.float32(value)))


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None
