"""The HTP export one layer group at a time (issue 34) against the same export with the whole float model, as every
HTP export ran before groups:
- calibrated and quantized by groups (export/htp/groups.py) on the same recorded traces, against ONNX Runtime's
  quantizer over the whole template: the same family, file for file (QDQ scales, zero points, weights, nodes, the
  weight file's bytes);
- the traces recorded by groups (export/calibration/streamed.py) against the float family run by the Engine: the
  same steps (tokens, positions, windows), their KV rows and the ranges equal up to float rounding."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import TINY_CONTEXTS, TINY_PREFILL
from onnx import numpy_helper

from staticlm.export.family import ExportOptions
from staticlm.runtime.family.quant_params import Quant


def _export(hf_dir: Path, out: Path, *, max_group_bytes: int | None) -> Path:
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.sources import load_model

    options = ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,), batch_sizes=(2,))
    export_quantized_family(load_model(hf_dir), out, options=options,
                            quant=QuantOptions(calib_steps=4, quant=Quant.W4A16, gptq=None,
                                               max_group_bytes=max_group_bytes))
    return out


def _graph(path: Path) -> tuple[dict, dict, list, list]:
    g = onnx.load(str(path), load_external_data=True).graph
    inits = {i.name: (numpy_helper.to_array(i).dtype.str, i.dims, numpy_helper.to_array(i).tobytes())
             for i in g.initializer}
    return (inits, {n.name: n.SerializeToString() for n in g.node}, [v.SerializeToString() for v in g.input],
            [v.SerializeToString() for v in g.output])


def test_a_family_quantized_by_layer_groups_equals_the_family_quantized_whole(tiny_hf_dir, tmp_path, monkeypatch):
    from staticlm.export.calibration import groups
    from staticlm.export.calibration.traces import record_traces
    from staticlm.export.htp import family, tables
    from staticlm.export.htp import groups as htp_groups

    monkeypatch.setattr(tables, "MIN_TABLE_BYTES", 0)  # the embedding and the head quantized by tables.py
    filled = []
    monkeypatch.setattr(htp_groups, "fill_tables", lambda model, found, *a: filled.extend(t.name for t in found)
                        or tables.fill_tables(model, found, *a))

    # the same traces for both (the Engine's); the streamed recording is compared on its own below
    monkeypatch.setattr(family, "record_traces_streamed", lambda float_dir, _fm, ids, max_bytes, **kw:
                        record_traces(float_dir, ids, **kw))
    split = []
    monkeypatch.setattr(family, "split_template", lambda *a, **kw: split.append(groups.split_template(*a, **kw))
                        or split[-1])
    whole = _export(tiny_hf_dir, tmp_path / "whole", max_group_bytes=None)
    assert not split  # the whole template in one quantizer pass
    grouped = _export(tiny_hf_dir, tmp_path / "grouped", max_group_bytes=0)  # one layer a group
    assert [len(s) for s in split] == [2, 2]  # the single graphs' template and the segmented one, 2 layers each
    assert sorted(filled) == ["embed", "embed", "lm_head_t", "lm_head_t"]

    a, b = (json.loads((d / "manifest.json").read_text()) for d in (whole, grouped))
    assert a["quantization"] == b["quantization"]  # the family's boundary parameters
    assert [g["file"] for g in a["graphs"]] == [g["file"] for g in b["graphs"]]
    for file in sorted({g["file"] for g in a["graphs"]}):
        want, got = _graph(whole / file), _graph(grouped / file)
        assert got[0].keys() == want[0].keys(), file
        assert [n for n in want[0] if got[0][n] != want[0][n]] == [], file  # scales, zero points, weights
        assert got[1] == want[1], file  # the same Q/DQ nodes, by name
        assert got[2:] == want[2:], file  # integer inputs and outputs, in order
    assert (grouped / "weights.bin").read_bytes() == (whole / "weights.bin").read_bytes()


@pytest.fixture(scope="module")
def float_family(tiny_hf_dir, tmp_path_factory):
    from staticlm.export.family import export_family
    from staticlm.export.sources import load_model

    options = ExportOptions(contexts=(64, 256), prefill_len=TINY_PREFILL, verify_lens=(4,), batch_sizes=(),
                            htp_style=True)  # a context past the short chats: the long conversation and its replay
    out = tmp_path_factory.mktemp("streamed") / "float"
    return out, export_family(load_model(tiny_hf_dir), out, options=options)


def test_traces_recorded_by_layer_groups_equal_the_engines_up_to_rounding(float_family):
    from staticlm.export.calibration.streamed import record_traces_streamed
    from staticlm.export.calibration.traces import calibration_prompts, record_traces, template_entry
    from staticlm.export.htp.family import _prompt_ids

    float_dir, fm = float_family
    ids, eos, first = _prompt_ids(float_dir, calibration_prompts())
    record = dict(max_steps=16, max_new_tokens=24, eos_ids=eos, sink_ids=first,
                  max_past_rows=template_entry(fm.graphs).shape.past_len)
    want = record_traces(float_dir, ids, **record)
    got = record_traces_streamed(float_dir, fm, ids, max_bytes=0, **record)  # one layer a group
    assert len(want.replay_steps) > 0 and len(want.sink_steps) > 0
    for a, b in zip((*want.steps, *want.replay_steps), (*got.steps, *got.replay_steps), strict=True):
        assert (b.position, b.token_ids.tolist(), b.past.shape) == (a.position, a.token_ids.tolist(), a.past.shape)
        np.testing.assert_allclose(b.past, a.past, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.kv_min, want.kv_min, atol=1e-5)
    np.testing.assert_allclose(got.kv_max, want.kv_max, atol=1e-5)
    assert (got.logits_min, got.logits_max) == pytest.approx((want.logits_min, want.logits_max), abs=1e-4)


def test_layer_groups_keep_within_the_bytes_a_layer_over_them_alone():
    from onnx import helper

    from staticlm.export.calibration.groups import layer_groups_within

    def init(name: str, n: int) -> onnx.TensorProto:
        return helper.make_tensor(name, onnx.TensorProto.FLOAT, [n], [0.0] * n)

    sizes = [10, 10, 30, 5, 5, 5]  # floats a layer
    model = helper.make_model(helper.make_graph([], "g", [], [], initializer=[
        init("embed", 5), init("lm_head_t", 5), *(init(f"l{k}.q", n) for k, n in enumerate(sizes))]))
    # embed with l0 (15 floats), head with l5 (10): l0 + l1 fill 25, l2 stands alone over it, l3..l5 make 20
    assert layer_groups_within(model, 6, max_bytes=4 * 25) == [(0, 2), (2, 3), (3, 6)]
    assert layer_groups_within(model, 6, max_bytes=0) == [(k, k + 1) for k in range(6)]
    assert layer_groups_within(model, 6, max_bytes=1 << 30) == [(0, 6)]


def test_the_memory_check_bounds_a_streamed_export_by_its_largest_group_not_the_model():
    """The pre-flight bound (export/htp/memory.py): streamed, it grows with one layer group and the traces, so a
    3B-shaped model (refused before on a 24 GiB machine: 2.3 x 13.4 GB of float weights) fits a 16 GB laptop, and
    twice the layers add only their traces."""
    from types import SimpleNamespace

    from staticlm.apps.bench.synthetic_gguf import SHAPES
    from staticlm.export.htp.memory import export_size

    def size(name: str, *, layers: int = 1):
        s = SHAPES[name]
        config = SimpleNamespace(num_layers=s.num_layers * layers, hidden_size=s.hidden_size,
                                 intermediate_size=s.intermediate_size, num_heads=s.num_heads,
                                 num_kv_heads=s.num_kv_heads, head_dim=s.hidden_size // s.num_heads,
                                 vocab_size=s.vocab_size)
        return export_size(config, max_group_bytes=512 << 20, num_steps=100, window_rows=192, max_context=2048)

    three, deeper = size("qwen2.5-3b"), size("qwen2.5-3b", layers=2)
    assert three.bytes_needed(streamed=False) > 24 << 30 > 16e9 > three.bytes_needed(streamed=True)
    assert deeper.bytes_needed(streamed=True) - three.bytes_needed(streamed=True) == deeper.traces - three.traces


def test_a_groups_calibration_runs_only_what_its_calibrated_tensors_need():
    """calibrate_group's graph (needed_part): the head's MatMul, whose output the family pins, and its table go; the
    norm before it stays and computes what the whole graph computes."""
    import onnxruntime as ort
    from onnx import helper

    from staticlm.export.calibration.activations import needed_part

    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    outs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, k]) for n, k in (("normed", 4), ("logits", 6))]
    scale, head = (rng.standard_normal(s).astype(np.float32) for s in ((4,), (4, 6)))
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Mul", ["x", "scale"], ["normed"], name="norm"),
         helper.make_node("MatMul", ["normed", "lm_head_t"], ["logits"], name="head")], "g", [x], outs,
        initializer=[numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(head, "lm_head_t")]))
    part, made = needed_part(model, ["normed"])
    assert [n.name for n in part.graph.node] == ["norm"] and "logits" not in made
    assert [i.name for i in part.graph.initializer] == ["scale"]
    assert [v.name for v in part.graph.output] == ["normed"] and [v.name for v in part.graph.input] == ["x"]
    feed = {"x": rng.standard_normal((1, 4)).astype(np.float32)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["normed"], feed)[0]
           for m in (model, part)]
    np.testing.assert_array_equal(run[1], run[0])
    assert needed_part(model, ["logits"])[0].graph.node[:] == model.graph.node[:]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
