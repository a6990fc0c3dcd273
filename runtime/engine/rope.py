"""RoPE cos/sin on the host, as Qualcomm's pipelines do: one table, one gather per step."""
from __future__ import annotations

import numpy as np

from staticlm.runtime.family.config import ModelConfig


def rope_cos_sin(config: ModelConfig, positions: np.ndarray, *, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [N, D] float64 for positions [N], in HF's rotate_half layout over the first rope_dims dims.

    The dims past rope_dims (partial rotary) pass through: cos 1, sin 0. Longrope's attention factor scales
    the rotated dims only, as transformers scales its cos/sin before applying them to those dims. local: the local
    layers' RoPE (config.local_inv_freq).
    """
    inv_freq = config.local_inv_freq() if local else config.inv_freq()
    angles = np.outer(np.asarray(positions, np.float64), inv_freq)  # [N, R/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [N, R]
    factor = 1.0 if local else config.rope_attention_factor
    rest = config.head_dim - config.rope_dims
    cos = np.concatenate([np.cos(angles) * factor, np.ones((len(angles), rest))], axis=-1)  # [N, D]
    sin = np.concatenate([np.sin(angles) * factor, np.zeros((len(angles), rest))], axis=-1)  # [N, D]
    return cos, sin


class RopeTable:
    def __init__(self, config: ModelConfig, *, max_positions: int | None = None, dtype=np.float32,
                 local: bool = False) -> None:
        self.max_positions = max_positions or config.max_positions
        cos, sin = rope_cos_sin(config, np.arange(self.max_positions), local=local)
        self.cos = cos.astype(dtype)  # [max_positions, D]
        self.sin = sin.astype(dtype)

    def fill(self, positions: np.ndarray, *, cos_out: np.ndarray, sin_out: np.ndarray) -> None:
        """positions [B, AR] -> cos_out/sin_out [B, 1, AR, D], written in place."""
        pos = np.minimum(positions, self.max_positions - 1)  # padded rows may run past the end; never read
        np.take(self.cos, pos, axis=0, out=cos_out[:, 0])
        np.take(self.sin, pos, axis=0, out=sin_out[:, 0])
