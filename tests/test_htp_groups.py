"""The HTP export calibrated and quantized one layer group at a time (export/htp/groups.py, issue 34) against the same
export quantized whole (ONNX Runtime's quantizer over the whole template, as every HTP export did before groups):
the same family, file for file: QDQ scales, zero points, weights, nodes, the weight file's bytes."""
from __future__ import annotations

import json
from pathlib import Path

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
    from staticlm.export.htp import family, groups

    split = []
    monkeypatch.setattr(family, "split_template", lambda *a, **kw: split.append(groups.split_template(*a, **kw))
                        or split[-1])
    whole = _export(tiny_hf_dir, tmp_path / "whole", max_group_bytes=None)
    assert not split  # the whole template in one quantizer pass
    grouped = _export(tiny_hf_dir, tmp_path / "grouped", max_group_bytes=0)  # one layer a group
    assert [len(s) for s in split] == [2, 2]  # the single graphs' template and the segmented one, 2 layers each

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


def test_layer_groups_keep_within_the_bytes_a_layer_over_them_alone():
    from onnx import helper

    from staticlm.export.htp.groups import layer_groups_within

    def init(name: str, n: int) -> onnx.TensorProto:
        return helper.make_tensor(name, onnx.TensorProto.FLOAT, [n], [0.0] * n)

    sizes = [10, 10, 30, 5, 5, 5]  # floats a layer
    model = helper.make_model(helper.make_graph([], "g", [], [], initializer=[
        init("embed", 5), init("lm_head_t", 5), *(init(f"l{k}.q", n) for k, n in enumerate(sizes))]))
    # embed with l0 (15 floats), head with l5 (10): l0 + l1 fill 25, l2 stands alone over it, l3..l5 make 20
    assert layer_groups_within(model, 6, max_bytes=4 * 25) == [(0, 2), (2, 3), (3, 6)]
    assert layer_groups_within(model, 6, max_bytes=0) == [(k, k + 1) for k in range(6)]
    assert layer_groups_within(model, 6, max_bytes=1 << 30) == [(0, 6)]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
