"""A GGUF grid in the HTP graph's form, x W = x Wl + (x E) C (export/graph/htp_grids.py, export/source_grid.py).

The reference is the gguf package's own quantizer and dequantizer, not our code."""
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from staticlm.export.graph.htp_grids import htp_grid
from staticlm.export.source_grid import BLOCK, block_indicator
from staticlm.export.sources.gguf_grids import decode_grid


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_blocks=st.integers(1, 6), n=st.integers(1, 40),
       spread=st.floats(1e-3, 1e3), qtype=st.sampled_from([T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]))
def test_grid_weights_decompose_exactly(seed, num_blocks, n, spread, qtype):
    w = (np.random.default_rng(seed).standard_normal((n, num_blocks * BLOCK)) * spread).astype(np.float32)
    raw = quantize(w, qtype)
    want = dequantize(raw, qtype).reshape(w.shape).T.astype(np.float64)  # [K, N]
    grid = htp_grid([decode_grid(qtype, raw, w.shape)])
    assert grid.levels.min() >= -(1 << (grid.bits - 1)) and grid.levels.max() < 1 << (grid.bits - 1)
    assert grid.bits == (4 if qtype in (T.Q4_0, T.Q4_1) else 8)
    symmetric = grid.symmetric_part().astype(np.float64)
    if grid.offsets is None:
        assert np.array_equal(symmetric, want)  # s l is gguf's weight itself
        return
    # x W == x Wl + (x E) C, the graph's form, for any x
    x = np.random.default_rng(seed + 1).standard_normal((3, w.shape[1]))
    direct = x @ want
    split = x @ symmetric + (x @ block_indicator(w.shape[1])) @ grid.offsets
    np.testing.assert_allclose(split, direct, rtol=1e-5, atol=1e-5 * np.abs(direct).max())
    # and each weight itself, to one float32 rounding of c
    rebuilt = symmetric + np.repeat(grid.offsets, BLOCK, axis=0)
    c = np.abs(np.repeat(grid.offsets, BLOCK, axis=0))
    assert (np.abs(rebuilt - want) <= np.spacing(np.maximum(c, np.abs(want)))).all()
