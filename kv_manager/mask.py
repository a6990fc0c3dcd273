"""The attention bias for a window: left padding masked, causal inside the AR block."""
from __future__ import annotations

import numpy as np

# Large but finite: -inf turns a fully masked padded row into NaN, and float32 min overflows to -inf in fp16.
MASK_VALUE = -10000.0


def attention_bias(*, lengths: np.ndarray, past_len: int, ar: int, out: np.ndarray | None = None,
                   dtype=np.float32, window: int = 0) -> np.ndarray:
    """[B, 1, AR, P + AR]: 0 where row i may attend, MASK_VALUE elsewhere.

    lengths[b] valid past rows sit at the right end of the P-row window (left padding). window W > 0: a sliding
    window, row i sees the last W tokens up to itself (new rows i-W+1..i and the newest W-1-i past rows).
    """
    lengths = np.asarray(lengths)
    if out is None:
        out = np.empty((lengths.size, 1, ar, past_len + ar), dtype)
    out.fill(MASK_VALUE)
    if window:
        _windowed(out, lengths=lengths, past_len=past_len, ar=ar, window=window)
        return out
    for b, n in enumerate(lengths.tolist()):  # B sequences, not layers: a handful of slice writes
        n = min(int(n), past_len)
        if n:
            out[b, 0, :, past_len - n:past_len] = 0
    if ar == 1:
        out[:, 0, 0, past_len] = 0
    else:
        causal = np.tril(np.ones((ar, ar), bool))
        out[:, 0, :, past_len:][:, causal] = 0
    return out


def _windowed(out: np.ndarray, *, lengths: np.ndarray, past_len: int, ar: int, window: int) -> None:
    """The sliding window's zeros into out [B, 1, AR, P + AR] (all MASK_VALUE): a few array operations."""
    rows = np.arange(ar)  # [AR]
    # past rows row i sees, the newest ones: the valid rows, the window's W-1-i, and no more than P
    seen = np.minimum(np.minimum(lengths, past_len)[:, None], np.maximum(window - 1 - rows, 0)[None])  # [B, AR]
    past_ok = np.arange(past_len)[None, None] >= past_len - seen[:, :, None]  # [B, AR, P]
    new_ok = (rows[None] <= rows[:, None]) & (rows[:, None] - rows[None] < window)  # [AR, AR]
    out[:, 0, :, :past_len][past_ok] = 0
    out[:, 0, :, past_len:][:, new_ok] = 0


def mask_quant_params(dtype) -> tuple[float, int]:
    """(scale, zero_point) that represent exactly {MASK_VALUE, 0} in an unsigned quantized mask."""
    qmax = np.iinfo(np.dtype(dtype)).max
    return -MASK_VALUE / qmax, int(qmax)


def quantize_bias(bias: np.ndarray, *, dtype=np.uint16, out: np.ndarray | None = None) -> np.ndarray:
    """The float bias in the graph's quantized mask form: q = round(x / scale) + zero_point."""
    scale, zero_point = mask_quant_params(dtype)
    q = np.clip(np.rint(bias / scale) + zero_point, 0, np.iinfo(np.dtype(dtype)).max)
    if out is None:
        return q.astype(dtype)
    out[...] = q
    return out


def dequantize_bias(q: np.ndarray) -> np.ndarray:
    scale, zero_point = mask_quant_params(q.dtype)
    return (q.astype(np.float32) - zero_point) * np.float32(scale)
