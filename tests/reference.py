"""The independent side of every parity test: transformers, and feeds built here by hand.

Nothing in this file imports staticlm.kv_manager or staticlm.runtime, so a bug there
cannot cancel itself out.
"""
from __future__ import annotations

import numpy as np
import torch

MASKED = -1e9


def hf_step(model, ids: np.ndarray, cache):
    """One transformers forward over `ids` [1, n] continuing `cache` (None = empty). Returns (logits, cache)."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), past_key_values=cache, use_cache=True)
    return out.logits.numpy(), out.past_key_values


def cache_kv(cache, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """([1, Hkv, L, D] keys, values) of one layer of a transformers cache."""
    lay = cache.layers[layer]
    return lay.keys.numpy().copy(), lay.values.numpy().copy()


def rope_tables(model, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [1, 1, AR, D] from the reference model's own rotary module."""
    pos = torch.tensor(positions[None], dtype=torch.long)
    dummy = torch.zeros(1, len(positions), model.config.hidden_size)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(dummy, pos)
    return cos.numpy()[:, None].astype(np.float32), sin.numpy()[:, None].astype(np.float32)


def padded_bias(*, num_valid: int, past_len: int, ar: int) -> np.ndarray:
    """[1, 1, AR, P+AR]: left padding masked, causal inside the new block."""
    bias = np.full((1, 1, ar, past_len + ar), MASKED, np.float32)
    bias[..., past_len - num_valid:past_len] = 0.0
    for i in range(ar):
        bias[0, 0, i, past_len:past_len + i + 1] = 0.0
    return bias


def graph_feeds(model, *, cache, ids: np.ndarray, past_len: int, num_kv_heads: int, num_layers: int) -> dict:
    """Feeds for one graph step: new tokens `ids` [1, AR] after the reference cache, left-padded into P."""
    ar = ids.shape[1]
    num_valid = 0 if cache is None else cache.get_seq_length()
    head_dim = model.config.head_dim
    cos, sin = rope_tables(model, np.arange(num_valid, num_valid + ar))
    feeds = {"input_ids": ids.astype(np.int64), "rope_cos": cos, "rope_sin": sin,
             "attention_bias": padded_bias(num_valid=num_valid, past_len=past_len, ar=ar)}
    for layer in range(num_layers):
        keys, values = cache_kv(cache, layer) if cache is not None else (None, None)
        for h in range(num_kv_heads):
            for name, src in ((f"past_key_{layer}_h{h}", keys), (f"past_value_{layer}_h{h}", values)):
                window = np.full((1, 1, past_len, head_dim), 7.0, np.float32)  # junk padding: must be masked
                if num_valid:
                    window[0, 0, past_len - num_valid:] = src[0, h]
                feeds[name] = window
    return feeds


def hf_greedy(model, prompt_ids: list[int], num_new: int, *, eos: int | None = None) -> list[int]:
    """transformers' own greedy generate."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()

