"""Scaled RoPE as data: the inverse frequencies (and attention factor) a source's scaling declares, computed once
at load, as transformers computes them (modeling_rope_utils) and as llama.cpp's tensors state them."""
from __future__ import annotations

import math

import numpy as np

from .model import UnsupportedSource


def base_inv_freq(theta: float, dims: int) -> np.ndarray:
    """[dims/2] float64: theta^(-2i/dims)."""
    return 1.0 / (theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims))


def llama3_inv_freq(theta: float, dims: int, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_positions: int) -> np.ndarray:
    """Llama 3.1's scaling: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    inv_freq = base_inv_freq(theta, dims)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original_max_positions / low_freq_factor, original_max_positions / high_freq_factor
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, out)


def divided_inv_freq(theta: float, dims: int, divisors: np.ndarray, *, name: str) -> np.ndarray:
    """llama.cpp's per-pair frequency divisors (GGUF `rope_freqs`, `rope_factors_long/short`)."""
    divisors = np.asarray(divisors, np.float64).reshape(-1)
    if divisors.size != dims // 2:
        raise UnsupportedSource(f"{name} has {divisors.size} RoPE factors for {dims} rotary dims")
    return base_inv_freq(theta, dims) / divisors


def longrope_attention_factor(*, max_positions: int, original_max_positions: int, factor: float | None = None,
                              attention_factor: float | None = None) -> float:
    """Longrope's cos/sin scale: given, else sqrt(1 + ln(factor) / ln(original)) (factor = max / original)."""
    if attention_factor is not None:
        return float(attention_factor)
    factor = factor if factor is not None else max_positions / original_max_positions
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_positions))
