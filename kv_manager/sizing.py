"""Models of KV memory (the shared buffer) and of BMC's allocation period."""
from __future__ import annotations

import math


def kv_bytes(*, num_layers: int, num_kv_heads: int, context: int, head_dim: int, bits: int,
             reserve: float = 2.0) -> int:
    """The shared KV buffer's size: reserve x 2 (K, V) x layers x heads x (S-1) x D x bits/8.

    With reserve 2 and Llama 7B (32 layers, 32 heads, D 128, 16-bit, S 2048): 2,146,435,072 bytes; reserve 1.5
    (S-1 + (S-1)/2 rows, fewer bytes for more compactions): 1,609,826,304.
    """
    # The fractional row count ((S-1) x 1.5 = 3070.5) is multiplied out, not rounded per buffer, so the formula
    # stays one product.
    return round(reserve * 2 * num_layers * num_kv_heads * (context - 1) * head_dim * bits / 8)


def _nearest_power_of_two(x: float) -> int:
    if x <= 1:
        return 1
    low = 2 ** math.floor(math.log2(x))
    return low if x - low <= 2 * low - x else 2 * low


def choose_bmc_r(*, max_context: int, copy_bandwidth: float | None = None, compute_rate: float | None = None,
                 c_prime: float | None = None) -> int:
    """BMC's analytical model: T = sqrt(N * aBW / (2 bC)) allocations, rounded to a power of two; r = N / T.

    Pass the measured copy bandwidth (aBW) and compute rate (bC) in consistent units, or C' = aBW / (2 bC)
    directly (the paper measures C' = 0.1 on AMD Genoa, giving T = 8 for N = 512).
    """
    if c_prime is None:
        if not copy_bandwidth or not compute_rate or copy_bandwidth <= 0 or compute_rate <= 0:
            raise ValueError("choose_bmc_r needs c_prime, or both copy_bandwidth and compute_rate > 0")
        c_prime = copy_bandwidth / (2.0 * compute_rate)
    if max_context < 1 or c_prime <= 0:
        raise ValueError(f"choose_bmc_r needs max_context >= 1 and C' > 0, got {max_context}, {c_prime}")
    num_allocations = min(_nearest_power_of_two(math.sqrt(c_prime * max_context)), max_context)
    return max(1, max_context // num_allocations)
