"""What every source becomes: a LoadedModel of HF-named float32 weights, a tokenizer and the chat metadata."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from staticlm.errors import UserError
from staticlm.runtime.family.config import ModelConfig, UnsupportedModel


class ModelSourceError(UserError, ValueError):
    """A model source that cannot be used; the message is one line, meant for the user."""


class UnsupportedSource(ModelSourceError, UnsupportedModel):
    """Readable, but not an architecture we export: catchable as either error."""


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]  # HF names, float32, HF [out, in] layout
    tokenizer_json: str  # a HF `tokenizers` tokenizer.json
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    source: str  # human description


def required_weight_names(config: ModelConfig) -> list[str]:
    """The HF-named tensors a LoadedModel of this config must carry (what export/graph/llama.py's write_weights
    reads)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names
