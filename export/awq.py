"""Activation-aware channel scaling before the per-channel weight rounding (Lin et al., 2023, "AWQ:
Activation-aware Weight Quantization for LLM Compression and Acceleration").

One scale per output column leaves every input row of a weight on the same grid, yet the rows that meet
large activations carry most of the output error. Scaling input row i of W by s_i and the activation by
1/s_i leaves the float product unchanged and gives those rows a finer grid. The 1/s goes where it costs
nothing: into the RMSNorm weight before Q/K/V and gate/up, and into the up columns before down (an output
column of a per-channel weight: its own scale absorbs it exactly). s = rms(x)^alpha, alpha chosen per input
by the output error tr(dW^T H dW) on the recorded inputs (H = X^T X, as GPTQ uses), alpha = 0 (no scaling)
among the candidates, so the error can only fall.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

ALPHAS = np.linspace(0.0, 1.0, 11)
MAX_RATIO = 1e3  # largest over smallest scale: the 16-bit per-tensor norm weights must still resolve 1/s


@dataclass(frozen=True)
class Fold:
    """Where the 1/s of one input goes: a vector (norm weight) or columns [start, stop) of a matrix."""
    name: str
    start: int | None = None
    stop: int | None = None


def fold_target(weight: str, views: dict[str, np.ndarray]) -> Fold | None:
    """The tensor producing the input this weight reads, by the HTP family's names (htp_graph.py). Weights
    with one fold target read one activation (Q reads it directly, K and V heads through a Reshape), so they
    take one s."""
    m = re.fullmatch(r"l(\d+)\.(q|k_h\d+|v_h\d+|gate_up|down)", weight)
    if not m:
        return None  # o: its input is the attention output (folding into V would move the recorded KV ranges)
    layer, kind = m.groups()
    if kind == "gate_up":
        return Fold(f"l{layer}.mlp_norm")
    if kind == "down":
        ff = views[f"l{layer}.gate_up"].shape[1] // 2  # [gate | up]: the down input is silu(gate) * up
        return Fold(f"l{layer}.gate_up", ff, 2 * ff)
    return Fold(f"l{layer}.attn_norm")


def output_error(w: np.ndarray, h: np.ndarray, *, qmin: float, qmax: float, s: np.ndarray) -> float:
    """tr(dW^T H dW) of nearest rounding with input rows scaled by s: w [in, out], h [in, in], s [in]."""
    ws = w * s[:, None]
    scales = 2.0 * np.abs(ws).max(axis=0) / (qmax - qmin)
    scales = np.where(scales > 0, scales, 1.0)
    dw = np.clip(np.round(ws / scales), qmin, qmax) * scales / s[:, None] - w
    return float(np.sum((h @ dw) * dw))


def choose_scales(w: np.ndarray, h: np.ndarray, *, qmin: float, qmax: float) -> np.ndarray:
    """[in] scales minimizing the output error of w [in, out] over rms(x)^alpha; all ones if none helps.
    (rms up to a constant factor, which the centring removes.)"""
    rms = np.sqrt(np.maximum(np.diag(h), 0.0))
    live = rms > 0
    if not live.any():
        return np.ones(w.shape[0], np.float32)
    floor = rms[live].max() / MAX_RATIO
    base = np.where(live, np.maximum(rms, floor), 1.0)
    best, best_s = None, np.ones(w.shape[0])
    for alpha in ALPHAS:
        s = base ** alpha
        s = s / np.sqrt(s[live].max() * s[live].min())  # centred on 1: neither side runs out of range
        s = np.where(live, s, 1.0)
        err = output_error(w, h, qmin=qmin, qmax=qmax, s=s)
        if best is None or err < best:
            best, best_s = err, s
    return best_s.astype(np.float32)


def apply_scales(views: dict[str, np.ndarray], names: list[str], fold: Fold, s: np.ndarray) -> None:
    """In place: rows of the named [in, out] weights times s, the fold target divided by s."""
    for n in names:
        views[n] *= s[:, None]
    target = views[fold.name]
    if fold.start is None:
        target /= s
    else:
        target[:, fold.start:fold.stop] /= s[None, :]
