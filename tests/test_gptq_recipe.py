"""Mixed precision for a float source's 4-bit projections (export/gptq/recipe.py, `--bits-budget`): the choice
under the budget, and the tiny model's mixed family against transformers' float model beside the plain 4-bit one."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import TINY_CONTEXTS, TINY_PREFILL, graph_path

from staticlm.export.gptq import recipe
from staticlm.export.gptq.options import GptqOptions
from staticlm.export.gptq.recipe import UnitCost


def _units(rng: np.random.Generator, count: int) -> list[UnitCost]:
    sizes = rng.choice([64 * 16, 64 * 32, 64 * 128], size=count)
    low = rng.uniform(1e-3, 1e-1, size=count)
    return [UnitCost((f"p{i}",), int(n), float(e), float(e) * rng.uniform(0.0, 0.1)) for i, (n, e) in
            enumerate(zip(sizes, low))]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [4.0, 4.25, 4.5, 5.0, 8.0])
def test_the_choice_stays_within_the_budget_and_leaves_no_unit_that_fits(seed, budget):
    units = _units(np.random.default_rng(seed), 40)
    high = recipe.choose_high(units, budget=budget, low_bits=4, high_bits=8)
    sizes = {u.names[0]: u.num_weights for u in units}
    bits = recipe.mean_bits(sizes, high, low_bits=4, high_bits=8)
    assert bits <= budget + 1e-12
    room = (budget - bits) * sum(sizes.values())
    assert all(4 * u.num_weights > room for u in units if u.names[0] not in high)  # greedy fill: nothing fits
    if budget == 8.0:
        assert high == set(sizes)
    if budget == 4.0:
        assert not high


def test_equal_units_go_to_eight_bits_in_the_order_of_their_error():
    rng = np.random.default_rng(3)
    low = rng.permutation(np.linspace(0.01, 0.2, 16))
    units = [UnitCost((f"p{i}",), 1024, float(e), float(e) / 20) for i, e in enumerate(low)]
    high = recipe.choose_high(units, budget=5.0, low_bits=4, high_bits=8)  # a quarter of the weights: 4 of 16
    assert high == {f"p{i}" for i in np.argsort(-low)[:4]}


def test_a_small_unit_that_removes_the_same_error_comes_first():
    units = [UnitCost(("big",), 4096, 0.1, 0.0), UnitCost(("small",), 1024, 0.1, 0.0)]
    assert recipe.choose_high(units, budget=7.2, low_bits=4, high_bits=8) == {"small"}  # room for one of them


def test_gate_and_up_of_a_layer_move_together():
    keys = {recipe.unit_key(f"model.layers.3.mlp.{p}.weight") for p in ("gate_proj", "up_proj")}
    assert len(keys) == 1
    assert recipe.unit_key("model.layers.3.mlp.down_proj.weight") not in keys
    assert recipe.unit_key("model.layers.4.mlp.gate_proj.weight") not in keys


def _tiny_options():
    from staticlm.export.family import ExportOptions

    return ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,), batch_sizes=())


def _layer_nbits(family) -> dict[str, int]:
    """Each layer MatMulNBits node of the decode graph -> its bits."""
    import onnx

    model = onnx.load(str(graph_path(family, "decode", ar=1)), load_external_data=False)
    return {n.input[1]: onnx.helper.get_node_attr_value(n, "bits") for n in model.graph.node
            if n.op_type == "MatMulNBits" and n.input[1].startswith("l")}


@pytest.mark.slow
def test_cpu_mixed_family_is_closer_to_float_than_plain_four_bit(tiny_hf_dir, tiny_hf_model, tmp_path):
    """`export --target cpu --calib --bits-budget 5`: 8-bit MatMulNBits for the chosen projections, at most 5 level
    bits per weight, and teacher-forced logits nearer transformers' float model than the same export at 4 bits."""
    from test_cpu_target import hf_teacher_forced, teacher_forced

    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.options import CpuOptions
    from staticlm.export.sources import load_model

    model = load_model(tiny_hf_dir)
    ids = np.frombuffer(b"Every winter the harbour town grows quiet, and the boats", np.uint8).astype(np.int64)
    want = hf_teacher_forced(tiny_hf_model, ids)
    errors = {}
    for name, budget in (("plain", None), ("mixed", 5.0)):
        gptq = GptqOptions(symmetric=False, offsets=True, sampled_tokens=16, bits_budget=budget)
        export_cpu_family(model, tmp_path / name, options=_tiny_options(),
                          cpu=CpuOptions(gptq=gptq, calib_steps=12, accuracy_level=0))
        errors[name] = float(np.sqrt(np.mean((teacher_forced(tmp_path / name, ids) - want) ** 2)))
    assert set(_layer_nbits(tmp_path / "plain").values()) == {4}
    assert set(_layer_nbits(tmp_path / "mixed").values()) == {4, 8}
    mixed = json.loads((tmp_path / "mixed" / "manifest.json").read_text())["extra"]["weight_rounding"]["mixed"]
    assert 4.0 < mixed["bits_per_weight"] <= 5.0
    sizes = {n: w.size for n, w in model.weights.items() if n.endswith("proj.weight")}
    assert mixed["bits_per_weight"] == pytest.approx(recipe.mean_bits(sizes, set(mixed["high"]), low_bits=4,
                                                                      high_bits=8))
    assert errors["mixed"] < 0.8 * errors["plain"], errors


@pytest.mark.slow
def test_htp_mixed_family_runs_on_the_cpu_ep_closer_to_float(tiny_hf_dir, tiny_hf_model, tmp_path):
    """`export --target htp --quant w4a16 --bits-budget 5`: the chosen projections as int8 blockwise
    DequantizeLinear, and the QDQ family (CPU EP) nearer transformers' float model than plain w4a16."""
    import onnx
    from test_cpu_target import hf_teacher_forced, teacher_forced

    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.sources import load_model
    from staticlm.runtime.family.quant_params import Quant

    model = load_model(tiny_hf_dir)
    ids = np.frombuffer(b"Every winter the harbour town grows quiet, and the boats", np.uint8).astype(np.int64)
    want = hf_teacher_forced(tiny_hf_model, ids)
    errors, int8_weights = {}, {}
    for name, budget in (("plain", None), ("mixed", 5.0)):
        gptq = GptqOptions(symmetric=True, sampled_tokens=16, bits_budget=budget)
        export_quantized_family(model, tmp_path / name, options=_tiny_options(),
                                quant=QuantOptions(quant=Quant.W4A16, calib_steps=24, gptq=gptq))
        errors[name] = float(np.sqrt(np.mean((teacher_forced(tmp_path / name, ids) - want) ** 2)))
        decode = sorted((tmp_path / name).glob("decode_s*.onnx"))[0]
        graph = onnx.load(str(decode), load_external_data=False).graph
        types = {i.name: i.data_type for i in graph.initializer}
        blockwise = [n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"
                     and any(a.name == "block_size" for a in n.attribute)]  # the layers' projections
        assert blockwise
        int8_weights[name] = {w for w in blockwise if types[w] == onnx.TensorProto.INT8}
    assert not int8_weights["plain"] and int8_weights["mixed"]
    assert errors["mixed"] < 0.9 * errors["plain"], errors


@pytest.mark.parametrize("args", [
    ("--target", "cpu", "--calib", "--bits-budget", "3.5"),
    ("--target", "cpu", "--calib", "--bits-budget", "lots"),
    ("--target", "cpu", "--bits-budget", "4.5"),
    ("--target", "htp", "--quant", "w8a16", "--bits-budget", "4.5"),
    ("--target", "htp", "--quant", "w4a16", "--rounding", "rtn", "--bits-budget", "4.5"),
    ("--bits-budget", "4.5",),
])
def test_bad_bits_budgets_are_one_line_errors(args, tmp_path):
    from test_cli_errors import assert_one_line_error, staticlm

    assert_one_line_error(staticlm("export", "--model", tmp_path / "missing", "--out", tmp_path / "o", *args),
                          "--bits-budget")
    assert not (tmp_path / "o").exists()
