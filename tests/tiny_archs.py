"""Tiny random models of every exported architecture, every feature on, saved as HF checkpoints and written as
F32 GGUF files the way llama.cpp's converter writes them (names, the llama q/k row permutation, RoPE tensors)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from conftest import CHATML, save_tiny_checkpoint, tiny_tokenizer_json

VOCAB = 260  # the byte-level tiny tokenizer: 256 bytes, then 4 specials
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, bos_token_id=259, eos_token_id=258)
NUM_ROT = 12  # Phi-4-mini style partial rotary: 0.75 of head_dim 16
PHI3_ORIGINAL = 16  # longrope's original context: the tests' families and prompts exceed it, so long factors run


GEMMA_WINDOW = 8  # local layers see 8 tokens: the tests' prompts and contexts are longer, so windows slide


def _configs():
    from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

    rng = np.random.default_rng(3)
    return {
        "llama": LlamaConfig(**BASE, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**BASE, max_position_embeddings=512, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False),
        "qwen3": Qwen3Config(**BASE, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False),
        "phi3": Phi3Config(**BASE, max_position_embeddings=256, original_max_position_embeddings=PHI3_ORIGINAL,
                           tie_word_embeddings=False, sliding_window=None, pad_token_id=0,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "partial_rotary_factor": NUM_ROT / 16,
                                            "short_factor": list(1.0 + rng.random(NUM_ROT // 2)),
                                            "long_factor": list(1.0 + 4 * rng.random(NUM_ROT // 2))}),
        # Six layers: llama.cpp's GGUF reader makes every sixth global (the converter writes no pattern); head_dim 32
        # is not hidden/heads (16); linear RoPE scaling on the global layers, base 10000 on the local ones
        "gemma3": Gemma3TextConfig(**{**BASE, "num_hidden_layers": 6}, head_dim=32, max_position_embeddings=512,
                                   tie_word_embeddings=True, query_pre_attn_scalar=32, sliding_window=GEMMA_WINDOW,
                                   hidden_activation="gelu_pytorch_tanh", pad_token_id=0,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    }


ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3")


def rope_parameters(config) -> dict:
    """The global layers' rope_parameters (Gemma 3 nests them per layer type)."""
    return config.rope_parameters.get("full_attention", config.rope_parameters)


def inv_freq(model, *, local: bool = False):
    """transformers' own inverse frequencies (the global layers', or Gemma 3's local ones), float64."""
    rotary = model.model.rotary_emb
    name = ("sliding_attention_" if local else "full_attention_") if hasattr(rotary, "layer_types") else ""
    return getattr(rotary, f"{name}original_inv_freq").numpy().astype(np.float64)


def build(arch: str, directory: Path, *, seed: int = 0):
    """A random model of arch saved in directory with the tiny tokenizer; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[arch], torch_dtype=torch.float32).eval()
    with torch.no_grad():  # random init is too flat for greedy tests to mean anything: sharpen it
        model.model.embed_tokens.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.3 * torch.randn_like(p))  # norms and biases away from 1 and 0, so they matter
    return save_tiny_checkpoint(model, directory)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rotate_half halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
          "mlp.gate_up_proj": "ffn_up"}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def write_gguf(model, path: Path, *, arch: str, metadata: dict | None = None,
               tensors: dict[str, np.ndarray] | None = None, quantize=None) -> Path:
    """model as an F32 GGUF of llama.cpp's layout; metadata/tensors add or replace entries (for bad files);
    quantize(gguf name, float array) may return (raw blocks, GGML type) to store that tensor quantized."""
    import gguf
    from tokenizers import Tokenizer

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = rope_parameters(cfg)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    out = {}
    freqs = inv_freq(model)
    dims = 2 * len(freqs)
    base = 1.0 / (rope["rope_theta"] ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    if rope["rope_type"] == "llama3":  # llama.cpp's per-pair divisors
        out["rope_freqs.weight"] = (base / freqs).astype(np.float32)
    if rope["rope_type"] == "longrope":
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
        factor = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        w.add_float32(f"{arch}.rope.scaling.attn_factor",
                      float(np.sqrt(1 + np.log(factor) / np.log(rope["original_max_position_embeddings"]))))
    gemma = arch == "gemma3"
    if gemma:  # convert_hf_to_gguf's Gemma3Model: the window, linear scaling; the local layers are llama.cpp's
        w.add_sliding_window(cfg.sliding_window)
        if rope["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    for name, value in model.state_dict().items():
        v = value.numpy().astype(np.float32)
        if gemma and name.endswith("norm.weight"):
            v = v + np.float32(1.0)  # the converter stores Gemma's (1 + w) norms as their sum
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in _GLOBAL:
            out[_GLOBAL[name]] = v
            continue
        parts = name.split(".")  # model.layers.{i}.{module...}.{weight|bias}
        module = ".".join(parts[3:-1])
        suffix = _GEMMA_LAYER[module] if gemma and module in _GEMMA_LAYER else _LAYER[module]
        gname = f"blk.{parts[2]}.{suffix}.{parts[-1]}"
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            v = _permute(v, cfg.num_attention_heads if module == "self_attn.q_proj" else cfg.num_key_value_heads)
        out[gname] = v
    out.update(tensors or {})
    tok = json.loads(tiny_tokenizer_json())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i >= 256 else 1 for i in range(len(tokens))])
    w.add_token_merges([])
    w.add_bos_token_id(259)
    w.add_eos_token_id(258)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)
    for key, value in (metadata or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
    for name, v in out.items():
        raw = quantize(name, v) if quantize is not None else None
        if raw is None:
            w.add_tensor(name, np.ascontiguousarray(v))
        else:  # (raw blocks [N, row bytes], GGML type): a quantized tensor
            w.add_tensor(name, raw[0], raw_dtype=raw[1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert Tokenizer.from_str(tiny_tokenizer_json()).get_vocab_size() == len(tokens)
    return path
