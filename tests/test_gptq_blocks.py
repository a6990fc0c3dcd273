"""Blockwise 4-bit GPTQ (export/gptq/): numpy properties of the rounding against round-to-nearest on the same grid,
GGUF grids left as they are, and the tiny model's w4a16 family on the HTP emulator against the CPU EP."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import TINY_CONTEXTS, TINY_PREFILL

from staticlm.export.gptq import rounding
from staticlm.export.gptq.options import GptqOptions, Rounding
from staticlm.export.gptq.rounding import Grid

SEQUENTIAL_HTP = GptqOptions(rounding=Rounding.SEQUENTIAL, symmetric=False, offsets=True, sampled_tokens=16)
SYMMETRIC, ASYMMETRIC = Grid(bits=4, block=32, symmetric=True), Grid(bits=4, block=32, symmetric=False)


def _layer(seed: int, *, num_in: int = 128, num_out: int = 48, num_rows: int = 1024):
    """Correlated inputs with a few loud channels (what real activations look like), a weight matrix with a few
    outliers."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(num_in, num_in)) / np.sqrt(num_in) + np.eye(num_in)
    x = rng.normal(size=(num_rows, num_in)) @ mix
    x[:, rng.choice(num_in, 4, replace=False)] *= 8.0
    w = rng.normal(size=(num_in, num_out)).astype(np.float32)
    w[rng.random(w.shape) < 0.01] *= 4.0
    return x[:num_rows // 2], x[num_rows // 2:], w


def _error(x: np.ndarray, w: np.ndarray, q: np.ndarray, scales, zeros, grid: Grid) -> float:
    return float(np.linalg.norm(x @ (w - rounding.dequantize(q, scales=scales, zeros=zeros, block=grid.block))))


@pytest.mark.parametrize("grid", [SYMMETRIC, ASYMMETRIC], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_block_gptq_beats_nearest_rounding_on_held_out_rows(grid, act_order, seed):
    fit, held_out, w = _layer(seed)  # judged on rows it was not fit to, as the model meets new text
    h = fit.T @ fit
    scales, zeros = rounding.searched_grid(w, np.diag(h), grid)
    q = rounding.gptq(w, h, scales=scales, zeros=zeros, grid=grid, act_order=act_order)
    assert np.array_equal(q, np.round(q)) and q.min() >= grid.lo and q.max() <= grid.hi  # levels of the grid
    nearest = rounding.nearest(w, scales=scales, zeros=zeros, grid=grid)
    ratio = _error(held_out, w, q, scales, zeros, grid) / _error(held_out, w, nearest, scales, zeros, grid)
    assert ratio < 0.93, ratio  # measured 0.78-0.88 over these seeds and grids


@pytest.mark.parametrize("grid", [SYMMETRIC, ASYMMETRIC], ids=["symmetric", "asymmetric"])
def test_scales_chosen_by_output_error_beat_each_blocks_range(grid):
    """Nearest rounding on the searched scales against the scales of each block's range alone, held-out rows."""
    fit, held_out, w = _layer(4)
    searched = rounding.searched_grid(w, np.diag(fit.T @ fit), grid)
    minmax = rounding.minmax_grid(w, grid)
    errors = [_error(held_out, w, rounding.nearest(w, scales=s, zeros=z, grid=grid), s, z, grid)
              for s, z in (searched, minmax)]
    assert errors[0] < 0.95 * errors[1], errors


def test_act_order_is_invariant_to_the_stored_order_of_rows():
    """Rows moved within their block, and blocks moved whole, give the same levels moved the same way: act-order
    depends on the inputs' energies and each row keeps its own block's scale (static groups)."""
    fit, _held_out, w = _layer(5)
    h = fit.T @ fit
    grid = ASYMMETRIC
    scales, zeros = rounding.searched_grid(w, np.diag(h), grid)
    q = rounding.gptq(w, h, scales=scales, zeros=zeros, grid=grid)
    rng = np.random.default_rng(0)
    num_blocks = w.shape[0] // grid.block
    block_perm = rng.permutation(num_blocks)
    perm = np.concatenate([b * grid.block + rng.permutation(grid.block) for b in block_perm])
    q_perm = rounding.gptq(w[perm], h[np.ix_(perm, perm)], scales=scales[block_perm], zeros=zeros[block_perm],
                           grid=grid)
    assert np.array_equal(q_perm, q[perm])
    # and without act-order the stored order matters (the property is not vacuous)
    q_stored = rounding.gptq(w[perm], h[np.ix_(perm, perm)], scales=scales[block_perm], zeros=zeros[block_perm],
                             grid=grid, act_order=False)
    assert not np.array_equal(q_stored, q[perm])


def test_dead_inputs_get_zero_weights():
    fit, _held_out, w = _layer(6)
    fit[:, 5] = 0.0
    h = fit.T @ fit
    scales, zeros = rounding.searched_grid(w, np.diag(h), SYMMETRIC)
    q = rounding.gptq(w, h, scales=scales, zeros=zeros, grid=SYMMETRIC)
    assert not q[5].any()


# --- the tiny model through both targets ---------------------------------------------------------------------


def _with_gguf_grids(model):
    """The q projections as a Q4_1 GGUF holds them (exact grids); every other projection float."""
    from test_htp import _q4_1_grid

    grids = {n: _q4_1_grid(w) for n, w in model.weights.items() if n.endswith("q_proj.weight")}
    return dataclasses.replace(model, weights={**model.weights, **{n: g.dequantize() for n, g in grids.items()}},
                               grids=grids)


@pytest.mark.slow
def test_calibrated_rounding_keeps_gguf_grids_and_rounds_the_rest(tiny_hf_dir, tmp_path):
    from staticlm.export.family import ExportOptions
    from staticlm.export.gptq.traces import calibrated_rounding
    from staticlm.export.sources import load_model

    model = _with_gguf_grids(load_model(tiny_hf_dir))
    options = ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,))
    gptq = GptqOptions(rounding=Rounding.SEQUENTIAL, symmetric=False, sampled_tokens=16)
    layers = []
    rounded, report = calibrated_rounding(model, tmp_path, options=options, gptq=gptq, calib_steps=12,
                                          step=lambda what: layers.append(what))
    for name, grid in model.grids.items():
        assert rounded.grids[name] is grid  # never rounded again
        assert np.array_equal(rounded.weights[name], model.weights[name])
    projections = [n for n in model.weights if n.endswith("proj.weight") and n not in model.grids]
    assert projections
    for name in projections:
        grid = rounded.grids[name]
        assert grid.qtype == "GPTQ" and grid.zeros is not None and grid.block == 32
        assert np.array_equal(rounded.weights[name], grid.dequantize())
        assert not np.array_equal(rounded.weights[name], model.weights[name])
    assert sum("GPTQ layer" in s for s in layers) == model.config.num_layers
    assert set(report["error"]) == {"k", "v", "o", "gate", "up", "down"}  # q kept its GGUF grid
    for row in report["error"].values():
        assert 0 < row["rounded"] < row["nearest"]


def _tiny_options():
    from staticlm.export.family import ExportOptions

    return ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,), batch_sizes=())


@pytest.mark.slow
@pytest.mark.parametrize(("grid", "block"), [("zero-points", 32), ("offsets", 32)])
def test_cpu_calib_family_computes_the_gptq_grids_exactly(tiny_hf_dir, tiny_hf_model, grid, block, tmp_path):
    """`export --target cpu --calib`: the family's logits are transformers' on the calibrated rounding's weights
    (rounded again independently of the family writer: ORT's CPU EP runs the traces deterministically), float
    activations (accuracy level 0) so only summation order differs; zero points are MatMulNBits' own (read back
    bit for bit, no correction rows), offsets add the per-block MatMul."""
    import copy

    import torch
    from test_cpu_target import dequantized_state_dict, hf_teacher_forced, teacher_forced

    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.options import CpuOptions
    from staticlm.export.gptq.traces import calibrated_rounding
    from staticlm.export.sources import load_model

    model = load_model(tiny_hf_dir)
    # every projection 4-bit: one MatMulNBits per linear, read back by dequantized_state_dict (a mixed family's
    # 8-bit parts: test_gptq_recipe.py)
    gptq = GptqOptions(symmetric=False, offsets=grid == "offsets", block=block, sampled_tokens=16, bits_budget=None)
    cpu = CpuOptions(gptq=gptq, calib_steps=12, accuracy_level=0, block_size=block)
    export_cpu_family(model, tmp_path / "family", options=_tiny_options(), cpu=cpu)
    rounded, _report = calibrated_rounding(model, tmp_path / "again", options=_tiny_options(), gptq=gptq,
                                           calib_steps=12, step=lambda _what: None)
    projections = [n for n in model.weights if n.endswith("proj.weight")]
    state = dequantized_state_dict(tmp_path / "family", tiny_hf_model.config)  # the head and norms as written
    if grid == "zero-points":
        for name in projections:
            assert np.array_equal(state[name].numpy(), rounded.weights[name]), name
    state.update({n: torch.tensor(rounded.weights[n]) for n in projections})
    ref = copy.deepcopy(tiny_hf_model)
    ref.load_state_dict(state, strict=False)
    ids = np.frombuffer(b"Every winter the harbour town grows quiet", np.uint8).astype(np.int64)
    got, want = teacher_forced(tmp_path / "family", ids), hf_teacher_forced(ref, ids)
    assert np.abs(got - want).max() < 2e-5 * np.abs(want).max()
    extra = json.loads((tmp_path / "family" / "manifest.json").read_text())["extra"]
    assert extra["weights"]["gptq"]["rounding"] == "act-order"
    assert set(extra["weight_rounding"]["error"]) == {"q", "k", "v", "o", "gate", "up", "down"}


@pytest.fixture(scope="module")
def tiny_w4_gptq(tiny_hf_dir, tmp_path_factory):
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.sources import load_model
    from staticlm.runtime.family.quant_params import Quant

    out = tmp_path_factory.mktemp("tiny_w4_gptq") / "family"
    quant = QuantOptions(quant=Quant.W4A16, calib_steps=24, gptq=SEQUENTIAL_HTP)
    export_quantized_family(load_model(tiny_hf_dir), out, options=_tiny_options(), quant=quant)
    return out


@pytest.mark.slow
@pytest.mark.htp
def test_htp_emulator_runs_the_gptq_w4a16_family_like_the_cpu_ep(tiny_w4_gptq, request, tmp_path):
    """The w4a16 family of GPTQ block grids (sequential, float offsets): every node on HTP with CPU fallback
    disabled, its logits and KV against the CPU EP on the same graphs (test_htp's check)."""
    from test_htp import test_htp_emulator_matches_cpu_ep

    extra = json.loads((tiny_w4_gptq / "manifest.json").read_text())["extra"]
    assert extra["weight_rounding"]["options"] == SEQUENTIAL_HTP.to_dict()
    test_htp_emulator_matches_cpu_ep("tiny_w4_gptq", request, tmp_path)


@pytest.mark.parametrize(("args", "word"), [
    (("--target", "cpu", "--calib", "--rounding", "fancy"), "rounding"),
    (("--target", "htp", "--quant", "w4a16", "--grid", "zero-points"), "grid"),
    (("--target", "cpu", "--weight-bits", "8", "--calib"), "calib"),
    (("--target", "cpu", "--rounding", "sequential"), "calib"),
])
def test_bad_rounding_options_are_one_line_errors(args, word, tmp_path):
    from test_cli_errors import assert_one_line_error, staticlm

    assert_one_line_error(staticlm("export", "--model", tmp_path / "missing", "--out", tmp_path / "o", *args), word)
    assert not (tmp_path / "o").exists()
