"""RoPE cos/sin on the host, as Qualcomm's pipelines do: one table, one gather per step."""
from __future__ import annotations

import numpy as np


class RopeTable:
    def __init__(self, *, head_dim: int, theta: float, max_positions: int, dtype=np.float32) -> None:
        inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
        angles = np.concatenate([angles, angles], axis=-1)  # [max_positions, D], HF's rotate_half layout
        self.cos = np.cos(angles).astype(dtype)
        self.sin = np.sin(angles).astype(dtype)
        self.max_positions = max_positions

    def fill(self, positions: np.ndarray, *, cos_out: np.ndarray, sin_out: np.ndarray) -> None:
        """positions [B, AR] -> cos_out/sin_out [B, 1, AR, D], written in place."""
        pos = np.minimum(positions, self.max_positions - 1)  # padded rows may run past the end; never read
        np.take(self.cos, pos, axis=0, out=cos_out[:, 0])
        np.take(self.sin, pos, axis=0, out=sin_out[:, 0])
