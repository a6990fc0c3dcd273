"""A MatMulNBits weight of more than MAX_NODE_WEIGHT_BYTES runs as several nodes over row ranges of its stored bytes
(export/cpu/linears.py node_rows): ORT packs each node's weight anew whenever a session opens, so the largest node is
memory held at once while a family opens. The ranges must store nothing twice and change no logit.

The tiny model's weights are far below the real bound: the bound (and the alignment the ranges start on) are lowered
for one export, and the other export of the same model keeps one node per weight.
"""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import graph_path
from test_cpu_target import dequantized_state_dict, export_tiny, hf_teacher_forced, teacher_forced

MAX_BYTES = 4096


@pytest.fixture(scope="module")
def families(tiny_hf_dir, tmp_path_factory) -> dict[str, Path]:
    from staticlm.export.cpu import linears

    root = tmp_path_factory.mktemp("node_rows")
    whole = export_tiny(tiny_hf_dir, root / "whole", accuracy_level=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linears, "MAX_NODE_WEIGHT_BYTES", MAX_BYTES)
        mp.setattr(linears, "ALIGNMENT", 1)  # a range may start at any row (the test below keeps the real one)
        split = export_tiny(tiny_hf_dir, root / "split", accuracy_level=0)
    return {"whole": whole, "split": split}


def _external(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    out = {}
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            e = {x.key: x.value for x in t.external_data}
            out[t.name] = (int(e.get("offset", 0)), int(e["length"]))
    return out


def test_a_large_weight_runs_as_row_ranges_of_the_bytes_stored_once(families, tiny_hf_model):
    digest = {name: hashlib.sha256((d / "weights.bin").read_bytes()).hexdigest() for name, d in families.items()}
    assert digest["split"] == digest["whole"]  # the same file: the ranges are names over its bytes
    whole = onnx.load(str(graph_path(families["whole"], "decode", ar=1)), load_external_data=False)
    split = onnx.load(str(graph_path(families["split"], "decode", ar=1)), load_external_data=False)
    where_whole, where_split = _external(whole), _external(split)
    attr = onnx.helper.get_node_attr_value
    nodes = [n for n in split.graph.node if n.op_type == "MatMulNBits"]
    assert max(where_split[n.input[1]][1] for n in nodes) <= MAX_BYTES
    vocab = tiny_hf_model.config.vocab_size
    head = [n for n in nodes if n.input[1].startswith("head_t.q")]
    assert len(head) > 1 and sum(attr(n, "N") for n in head) == vocab
    # each input of the head's nodes: consecutive ranges that tile the whole family's tensor of that input exactly
    for slot in range(1, len(head[0].input)):
        stored = head[0].input[slot].rsplit(".rows", 1)[0]
        offset, length = where_whole[stored]
        for n in head:
            start, size = where_split[n.input[slot]]
            assert start == offset and size * vocab == length * attr(n, "N"), n.input[slot]
            offset += size
        assert offset == sum(where_whole[stored])
    # the outputs side by side in row order, then the head's logits
    concat = [n for n in split.graph.node if n.op_type == "Concat" and set(n.input) == {m.output[0] for m in head}]
    assert len(concat) == 1 and list(concat[0].input) == [m.output[0] for m in head]


def test_row_ranges_give_transformers_logits_on_the_same_weights(families, tiny_hf_model):
    # accuracy_level 0: against transformers on the weights dequantized (numpy) from the one-node family's graph,
    # whose weight file is the split family's byte for byte
    ids = np.random.default_rng(11).integers(0, tiny_hf_model.config.vocab_size, 40)
    ref = copy.deepcopy(tiny_hf_model)
    ref.load_state_dict(dequantized_state_dict(families["whole"], ref.config), strict=False)
    want = hf_teacher_forced(ref, ids)
    got = teacher_forced(families["split"], ids)
    assert np.abs(got - want).max() < 2e-5 * np.abs(want).max()
    whole = teacher_forced(families["whole"], ids)  # the same columns: MLAS tiles a narrower node apart (an ulp)
    assert np.abs(got - whole).max() < 1e-6 * np.abs(whole).max() and (got.argmax(-1) == whole.argmax(-1)).all()


def test_each_range_starts_on_the_weight_files_alignment_in_every_tensor_it_slices(tmp_path, monkeypatch):
    from staticlm.export.cpu import linears
    from staticlm.export.cpu.linear_parts import MatMulPart
    from staticlm.export.weight_file import ALIGNMENT, WeightFileWriter

    monkeypatch.setattr(linears, "MAX_NODE_WEIGHT_BYTES", 1 << 20)
    n, k = 5000, 1536  # a tied head's shape, fewer rows: 8-bit levels in blocks of 16, scales, zero points
    writer = WeightFileWriter(tmp_path / "weights.bin")
    tensors = {"head.q": np.zeros((n, k // 16, 16), np.uint8), "head.scales": np.zeros((n, k // 16), np.float32),
               "head.zp": np.zeros((n, k // 16), np.uint8)}
    for name, array in tensors.items():
        writer.add(name, array)
    part = MatMulPart(weight="head", n=n, bits=8, block=16, zero_points=True, corrected=False, symmetric=False)
    rows = linears.node_rows(writer, part)
    assert sum(rows) == n and len(rows) > 1
    starts = np.cumsum((0, *rows[:-1]))
    for name, array in tensors.items():
        row_bytes = array.nbytes // n
        assert all(start * row_bytes % ALIGNMENT == 0 for start in starts), name
        # the most rows so aligned within the bound (or one aligned step where that is more)
        assert rows[0] * tensors["head.q"].nbytes // n <= max(1 << 20, rows[0] * 1536)
    writer.close()
