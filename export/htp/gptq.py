"""GPTQ rounding of the HTP family's per-channel weights (Frantar et al., 2022, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers").

Rounding every weight to its nearest grid point ignores what the layer's inputs look like. GPTQ rounds one
input row at a time and moves each row's rounding error onto the rows not yet rounded, weighted by the
inverse Hessian H = X^T X of the layer's real inputs X (recorded on the calibration traces), so the
layer's *outputs* stay close to float. The grid is unchanged: symmetric, one scale per output column,
the scale ORT's quantizer would pick. ORT's quantizer then writes exactly these integers, because it is
handed the GPTQ values (multiples of the scales) with the scales as per-channel overrides.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx

from staticlm.export.calibration.activations import hessians, weight_inputs
from staticlm.export.gptq import rounding


def channel_scales(w: np.ndarray, qmin: np.ndarray, qmax: np.ndarray) -> np.ndarray:
    """[in, out] -> [out]: the symmetric per-column scale, by ORT's formula (compute_scale_zp, vectorized)."""
    absmax = np.abs(w).max(axis=0).astype(np.float64)
    scales = (2.0 * absmax / (float(qmax) - float(qmin))).astype(np.float32)
    return np.where(scales > 0, scales, np.float32(1.0))  # an all-zero column: any scale is exact


def gptq(w: np.ndarray, h: np.ndarray, *, scales: np.ndarray, qmin: np.ndarray, qmax: np.ndarray) -> np.ndarray:
    """w [in, out] float, h [in, in] -> the rounded weights (integer multiples of scales [out], in [qmin, qmax]).

    Rows are rounded in the order of their input's energy (act-order, see export/gptq/rounding.py): on SmolLM2
    w8a16 it raised top-1 agreement with float over the stored order (same Hessians)."""
    order = np.argsort(-np.diag(h), kind="stable")
    s = np.broadcast_to(scales.astype(np.float32), w.shape)  # [in, out]: one scale per column, for every row
    q = rounding.sweep(w[order], h[np.ix_(order, order)], s=s, z=np.zeros_like(s), lo=int(qmin), hi=int(qmax),
                       damp=rounding.DAMP)[np.argsort(order)]
    return (q * scales.astype(np.float32)).astype(np.float32)


def round_weights(float_path: Path, weights_path: Path, steps: Iterable[tuple[dict[str, np.ndarray], int]], *,
                  weights: list[str], qtype) -> dict[str, list[dict]]:
    """GPTQ-round the named [in, out] weights of float_path's graph in its weight file, in place; returns the
    per-channel overrides (scale, zero point 0) that make ORT's quantizer write exactly these integers."""
    from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType

    qmin, qmax = get_qmin_qmax_for_qType(qtype.tensor_type, symmetric=True)  # numpy scalars, as ORT uses them
    model = onnx.load(str(float_path), load_external_data=False)
    inputs = weight_inputs(model, weights)
    h = hessians(float_path, steps, sorted(set(inputs.values())))
    stored = np.memmap(weights_path, dtype=np.uint8, mode="r+")
    views = {}
    for init in model.graph.initializer:
        if init.name in inputs:
            info = {e.key: e.value for e in init.external_data}
            offset, length = int(info.get("offset", 0)), int(info["length"])
            views[init.name] = stored[offset:offset + length].view(np.float32).reshape(tuple(init.dims))  # [in, out]
    overrides = {}
    for x in sorted(set(inputs.values())):  # weights reading one input share its Hessian: round them as one matrix
        names = sorted(n for n, i in inputs.items() if i == x)
        w = np.concatenate([views[n] for n in names], axis=1)
        scales = channel_scales(w, qmin, qmax)
        rounded = gptq(w, h[x], scales=scales, qmin=qmin, qmax=qmax)
        bounds = np.cumsum([0] + [views[n].shape[1] for n in names])
        for n, a, b in zip(names, bounds[:-1], bounds[1:]):
            views[n][:] = rounded[:, a:b]
            overrides[n] = [{"quant_type": qtype, "symmetric": True, "axis": 1, "scale": sc, "zero_point": 0}
                            for sc in scales[a:b]]
    stored.flush()
    return overrides
