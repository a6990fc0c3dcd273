"""GPTQ rounding and AWQ scaling (export/gptq.py, export/awq.py) against round-to-nearest on the same grid: numpy only."""
from __future__ import annotations

import numpy as np
import pytest
from onnxruntime.quantization import QuantType
from onnxruntime.quantization.quant_utils import get_qmin_qmax_for_qType, quantize_data

from staticlm.export import awq, gptq


def _layer(seed: int, *, num_in: int = 96, num_out: int = 40, num_rows: int = 1024):
    """Correlated inputs with a few loud channels (what real activations look like) and a weight matrix."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(num_in, num_in)) / np.sqrt(num_in) + np.eye(num_in)
    x = rng.normal(size=(num_rows, num_in)) @ mix
    x[:, rng.choice(num_in, 4, replace=False)] *= 8.0
    return x, rng.normal(size=(num_in, num_out)).astype(np.float32)


@pytest.mark.parametrize("qtype", [QuantType.QInt8, QuantType.QInt4])
@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_beats_nearest_rounding_on_the_same_grid(qtype, seed):
    x, w = _layer(seed)
    qmin, qmax = get_qmin_qmax_for_qType(qtype.tensor_type, symmetric=True)
    scales = gptq.channel_scales(w, qmin, qmax)
    # the scales are the ones ORT's own quantizer picks for each column
    for j in (0, w.shape[1] - 1):
        _zp, scale, _q = quantize_data(w[:, j], qtype.tensor_type, True)
        assert np.isclose(scales[j], scale, rtol=1e-6)
    fit, held_out = x[:512], x[512:]  # judged on rows it was not fit to, as the model meets new text
    q = gptq.gptq(w, fit.T @ fit, scales=scales, qmin=qmin, qmax=qmax)
    steps = q / scales
    assert np.allclose(steps, np.round(steps), atol=1e-3)  # on the grid: ORT's quantizer keeps these integers
    assert np.round(steps).min() >= qmin and np.round(steps).max() <= qmax
    nearest = np.clip(np.round(w / scales), qmin, qmax) * scales
    err_gptq, err_nearest = (np.linalg.norm(held_out @ (w - r)) for r in (q, nearest))
    assert err_gptq < 0.9 * err_nearest, (err_gptq, err_nearest)  # measured 0.76-0.85 over seeds 0-3


def test_dead_inputs_get_zero_weights():
    x, w = _layer(2)
    x[:, 5] = 0.0
    qmin, qmax = get_qmin_qmax_for_qType(QuantType.QInt8.tensor_type, symmetric=True)
    q = gptq.gptq(w, x.T @ x, scales=gptq.channel_scales(w, qmin, qmax), qmin=qmin, qmax=qmax)
    assert not q[5].any() and np.isfinite(q).all()


def _nearest(w, qmin, qmax):
    scales = gptq.channel_scales(w, qmin, qmax)
    return np.clip(np.round(w / scales), qmin, qmax) * scales


@pytest.mark.parametrize("seed", [0, 1])
def test_awq_scaling_lowers_held_out_error_and_keeps_the_float_product(seed):
    x, w = _layer(seed)
    x[:, :4] *= 6.0  # louder channels than _layer's: the rows AWQ should give a finer grid
    qmin, qmax = get_qmin_qmax_for_qType(QuantType.QInt8.tensor_type, symmetric=True)
    fit, held_out = x[:512], x[512:]
    norm = np.random.default_rng(seed).uniform(0.5, 2.0, w.shape[0]).astype(np.float32)  # the RMSNorm weight
    views = {"l0.q": w.copy(), "l0.attn_norm": norm.copy()}
    fold = awq.fold_target("l0.q", views)
    assert awq.fold_target("l0.v_h1", views) == fold  # V heads read the same activation through a Reshape
    assert fold == awq.Fold("l0.attn_norm")
    s = awq.choose_scales(w, fit.T @ fit, qmin=float(qmin), qmax=float(qmax))
    awq.apply_scales(views, ["l0.q"], fold, s)
    # the float model is unchanged: (x * norm / s) @ (s * W) == (x * norm) @ W
    assert np.allclose((held_out * views["l0.attn_norm"]) @ views["l0.q"], (held_out * norm) @ w, rtol=1e-4, atol=1e-3)
    scaled = (held_out * views["l0.attn_norm"]) @ _nearest(views["l0.q"], qmin, qmax)
    plain = (held_out * norm) @ _nearest(w, qmin, qmax)
    ref = (held_out * norm) @ w
    err_awq, err_plain = np.linalg.norm(scaled - ref), np.linalg.norm(plain - ref)
    assert err_awq < 0.9 * err_plain, (err_awq, err_plain)  # measured 0.58-0.82 over seeds 0-3


def test_awq_folds_the_down_input_into_the_up_columns():
    rng = np.random.default_rng(3)
    hidden, ff = 8, 6
    views = {"l2.gate_up": rng.normal(size=(hidden, 2 * ff)).astype(np.float32),
             "l2.down": rng.normal(size=(ff, hidden)).astype(np.float32)}
    before = {k: v.copy() for k, v in views.items()}
    fold = awq.fold_target("l2.down", views)
    assert fold == awq.Fold("l2.gate_up", ff, 2 * ff)
    awq.apply_scales(views, ["l2.down"], fold, rng.uniform(0.5, 4.0, ff).astype(np.float32))

    def mlp(v, x):
        gate, up = np.split(x @ v["l2.gate_up"], 2, axis=-1)
        return (gate / (1 + np.exp(-gate)) * up) @ v["l2.down"]

    x = rng.normal(size=(5, hidden)).astype(np.float32)
    assert np.allclose(mlp(views, x), mlp(before, x), rtol=1e-4, atol=1e-5)
    assert np.array_equal(views["l2.gate_up"][:, :ff], before["l2.gate_up"][:, :ff])  # the gate is untouched
    assert awq.fold_target("l2.o", views) is None  # the attention output has nowhere exact to go


def test_awq_choice_is_never_worse_than_plain_rounding_on_its_rows():
    x = np.random.default_rng(4).normal(size=(256, 32))
    w = np.random.default_rng(5).normal(size=(32, 16)).astype(np.float32)
    qmin, qmax = get_qmin_qmax_for_qType(QuantType.QInt8.tensor_type, symmetric=True)
    s = awq.choose_scales(w, x.T @ x, qmin=float(qmin), qmax=float(qmax))
    h = x.T @ x
    # alpha = 0 is a candidate: whatever is chosen is no worse than plain rounding on the fit rows
    assert awq.output_error(w, h, qmin=float(qmin), qmax=float(qmax), s=s) <= \
        awq.output_error(w, h, qmin=float(qmin), qmax=float(qmax), s=np.ones(32)) + 1e-9
