"""The model's architecture, as the exporter and runtime both need it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from staticlm.errors import UserError


class UnsupportedModel(UserError, ValueError):
    """The source is readable but not a Llama-family model we can export."""


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family hyper-parameters (RMSNorm, RoPE, GQA, SwiGLU)."""

    architecture: str  # "llama" or "qwen2"
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"{self.num_heads} query heads do not group evenly over {self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2:
            raise UnsupportedModel(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)
