"""The block sums of a source grid's offsets: x W = x Wl + (x E) C, with E the 0/1 block indicator (both targets
carry a grid's per-block offsets C this way: export/graph/htp_grids.py, export/cpu/linears.py)."""
from __future__ import annotations

import numpy as np

BLOCK = 32  # every GGUF type with minima has blocks of 32 inputs


def block_indicator(k: int, block: int = BLOCK) -> np.ndarray:
    """[k, k / block] float32: x E sums each block of x."""
    return np.kron(np.eye(k // block, dtype=np.float32), np.ones((block, 1), np.float32))
