"""The model's architecture, as the exporter and runtime both need it."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from staticlm.errors import UserError


class UnsupportedModel(UserError, ValueError):
    """The source is readable but not a Llama-family model we can export."""


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family hyper-parameters (RMSNorm, RoPE, GQA, SwiGLU) and the per-architecture features the one graph
    builder reads. The architecture's name is a label: builders read the feature fields, never the name."""

    architecture: str  # "llama", "qwen2", "qwen3", "phi3" or "gemma3" (export/sources/architectures.py)
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2-style q/k/v bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
    rotary_dim: int = 0  # dims rotated per head, the first ones (Phi-4-mini's partial rotary); 0: all of head_dim
    # RoPE as data: the rotary_dim/2 inverse frequencies of a scaled RoPE (llama3, longrope); (): theta's own.
    rope_inv_freq: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0  # longrope: cos and sin are scaled by it
    # longrope's second set, for a family whose largest context exceeds rope_original_max_positions (for_context)
    rope_long_inv_freq: tuple[float, ...] = ()
    rope_original_max_positions: int = 0
    # A sliding window (Mistral, Phi-3-mini-4k): exported only for families whose contexts fit it, where every
    # token sees every cached one, as in full attention (for_context); 0: none.
    sliding_window: int = 0
    # Gemma 3 (all defaults: off)
    mlp_activation: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation)
    embedding_scale: float = 1.0  # the embedded rows times this (Gemma: sqrt(hidden), in the embedding's dtype)
    sandwich_norms: bool = False  # an RMSNorm on the attention's and the MLP's outputs, before each residual add
    query_pre_attn_scalar: float = 0.0  # the softmax scale is 1/sqrt(this); 0: 1/sqrt(head_dim)
    # Local layers: each token sees the last local_window tokens (itself included), RoPE base local_rope_theta
    # (default RoPE, no scaling); the other layers attend over the whole context. The kv_manager keeps a local
    # layer's newest rows only (kv_manager/layered.py).
    local_window: int = 0
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float = 0.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"{self.num_heads} query heads do not group evenly over {self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise UnsupportedModel(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.rope_dims % 2 or not 0 < self.rope_dims <= self.head_dim:
            raise UnsupportedModel(f"rotary dims {self.rotary_dim} do not fit head_dim {self.head_dim}")
        for freqs in (self.rope_inv_freq, self.rope_long_inv_freq):
            if freqs and len(freqs) != self.rope_dims // 2:
                raise UnsupportedModel(f"{len(freqs)} RoPE frequencies for {self.rope_dims} rotary dims")
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise UnsupportedModel(f"MLP activation {self.mlp_activation!r} is not supported")
        if bool(self.local_layers) != bool(self.local_window) or any(
                not 0 <= i < self.num_layers for i in self.local_layers) or self.local_window < 0:
            raise UnsupportedModel(f"local layers {list(self.local_layers)} with window {self.local_window} do not "
                                   f"fit {self.num_layers} layers")
        if self.local_layers and len(set(self.local_layers)) == self.num_layers:  # the cache counts tokens there
            raise UnsupportedModel(f"all {self.num_layers} layers are local (sliding-window) layers: a model needs a "
                                   "global one (a Gemma 3 draft: keep a layer past the first local run)")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_dims(self) -> int:
        """Dims of each head that RoPE rotates (the first ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q.k: every graph style reads it here, and only here."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def is_local(self, layer: int) -> bool:
        return layer in self.local_layers

    def layer_past_len(self, layer: int, past_len: int) -> int:
        """Rows of a layer's past window in a graph of past length P: a local layer's past holds at most W-1
        rows (with the new token, W), a global layer's all P."""
        return min(past_len, self.local_window - 1) if self.is_local(layer) else past_len

    def local_inv_freq(self) -> np.ndarray:
        """[rope_dims/2] float64: the local layers' inverse frequencies (default RoPE over local_rope_theta)."""
        theta = self.local_rope_theta or self.rope_theta
        return 1.0 / (theta ** (np.arange(0, self.rope_dims, 2, dtype=np.float64) / self.rope_dims))

    def inv_freq(self) -> np.ndarray:
        """[rope_dims/2] float64 inverse frequencies: RoPE angle of pair i at position p is p * inv_freq[i]."""
        if self.rope_inv_freq:
            return np.asarray(self.rope_inv_freq, np.float64)
        return 1.0 / (self.rope_theta ** (np.arange(0, self.rope_dims, 2, dtype=np.float64) / self.rope_dims))

    def for_context(self, max_context: int) -> ModelConfig:
        """The config a family of contexts up to max_context runs: longrope's long set when it exceeds the original
        positions (as transformers picks for a sequence that long), else the short one; one set remains. A sliding
        window shorter than max_context is refused."""
        if self.sliding_window and max_context > self.sliding_window:
            raise UnsupportedModel(f"sliding-window attention ({self.sliding_window}) is not supported for a "
                                   f"context of {max_context}: export contexts of at most {self.sliding_window}")
        if not self.rope_long_inv_freq:
            return self
        long = max_context > self.rope_original_max_positions
        return replace(self, rope_inv_freq=self.rope_long_inv_freq if long else self.rope_inv_freq,
                       rope_long_inv_freq=())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """Also reads manifests written before a field existed (its default applies)."""
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = set(data) - set(kinds)
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
