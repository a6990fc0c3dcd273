"""The source's Q4_1 block grid, recovered from dequantized weights (export/source_grid.py).

The reference is the gguf package's own Q4_1 quantizer and dequantizer, not our code."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from staticlm.export.source_grid import BLOCK, block_grid, block_indicator


def q4_1(w_out_in: np.ndarray) -> np.ndarray:
    """[out, in] -> the same weights as a Q4_1 GGUF file stores them, dequantized, as [in, out]."""
    t = GGMLQuantizationType.Q4_1
    return np.ascontiguousarray(dequantize(quantize(w_out_in.astype(np.float32), t), t).T)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_blocks=st.integers(1, 6), n=st.integers(1, 40),
       spread=st.floats(1e-3, 1e3))
def test_q4_1_weights_decompose_exactly(seed, num_blocks, n, spread):
    w = q4_1(np.random.default_rng(seed).standard_normal((n, num_blocks * BLOCK)) * spread)  # [K, N]
    grid = block_grid(w)
    assert grid is not None
    assert grid.levels.min() >= -8 and grid.levels.max() <= 7
    # x W == x Wq + (x E) C, the graph's form, for any x
    x = np.random.default_rng(seed + 1).standard_normal((3, w.shape[0]))
    direct = x @ w.astype(np.float64)
    split = x @ grid.symmetric_part().astype(np.float64) + (x @ block_indicator(w.shape[0])) @ grid.offsets
    np.testing.assert_allclose(split, direct, rtol=1e-5, atol=1e-5 * np.abs(direct).max())
    # and each weight itself, to float32 rounding
    rebuilt = grid.symmetric_part() + np.repeat(grid.offsets, BLOCK, axis=0)
    np.testing.assert_allclose(rebuilt, w, rtol=0, atol=1e-6 * np.abs(w).max())


@pytest.mark.parametrize("make", [
    lambda rng: rng.standard_normal((64, 8)).astype(np.float32),  # a float source
    lambda rng: rng.standard_normal((48, 8)).astype(np.float32),  # K not a multiple of the block
    lambda rng: q4_1(rng.standard_normal((8, 64))) + np.float32(1e-3) * rng.standard_normal((64, 8)),  # near miss
])
def test_weights_off_a_grid_are_not_claimed(make):
    assert block_grid(make(np.random.default_rng(0))) is None
