"""The quantized HTP family (`export --target htp`): integer KV boundary read from the ONNX files themselves,
CPU-EP emulation against the float family, the HTP emulator against the CPU EP, SmolLM2 accuracy, bad input."""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import THREADS, TINY_CONTEXTS, TINY_PREFILL
from onnx import helper, numpy_helper
from test_cli_errors import assert_one_line_error, staticlm

from staticlm.export.family import ExportOptions, export_family
from staticlm.export.htp.options import QuantOptions
from staticlm.export.htp.plan import GraphPlan
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.engine.graphs import token_graphs
from staticlm.runtime.family.quant_params import KVBits, Quant
from staticlm.runtime.session.device import Device, DeviceOptions

CPU = DeviceOptions(device=Device.CPU, num_threads=THREADS)
HTP = DeviceOptions(device=Device.HTP)
TEXT = b"Every winter the harbour town grows quiet; the ferries run less."  # 56 bytes: fits context 64


def _export(hf_dir: Path, out: Path, *, q4_1_source: bool = False, **quant) -> Path:
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.sources import load_model

    model = load_model(hf_dir)
    if q4_1_source:  # the projections as a Q4_1 GGUF holds them (the gguf package's quantizer), with their grids
        grids = {n: _q4_1_grid(w) for n, w in model.weights.items() if n.endswith("proj.weight")}
        model = dataclasses.replace(model, weights={**model.weights, **{n: g.dequantize() for n, g in grids.items()}},
                                    grids=grids)
    # the device plan (export/htp/plan.py): per rung a prompt graph and a 4-row token graph that decodes, the sink;
    # no batch sizes (the segmented batched graphs: tests/test_segment_htp.py)
    plan = GraphPlan(contexts=TINY_CONTEXTS, prompt_len=TINY_PREFILL, token_len=4)
    export_quantized_family(model, out, plan=plan, quant=QuantOptions(calib_steps=24, **quant))
    return out


def _q4_1(w: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    return dequantize(quantize(w.astype(np.float32), GGMLQuantizationType.Q4_1), GGMLQuantizationType.Q4_1)


def _q4_1_grid(w: np.ndarray):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from staticlm.export.sources.gguf_grids import decode_grid

    return decode_grid(GGMLQuantizationType.Q4_1, quantize(w.astype(np.float32), GGMLQuantizationType.Q4_1), w.shape)


@pytest.fixture(scope="session")
def tiny_grid(tiny_hf_dir, tmp_path_factory) -> Path:
    return _export(tiny_hf_dir, tmp_path_factory.mktemp("tiny_grid") / "family", q4_1_source=True)


@pytest.fixture(scope="session")
def tiny_grid4(tiny_hf_dir, tmp_path_factory) -> Path:
    return _export(tiny_hf_dir, tmp_path_factory.mktemp("tiny_grid4") / "family", q4_1_source=True,
                   quant=Quant.W4A16)


@pytest.fixture(scope="session")
def tiny_w4(tiny_hf_dir, tmp_path_factory) -> Path:
    # round-to-nearest (`--rounding rtn`); the GPTQ family: tests/test_gptq_blocks.py
    return _export(tiny_hf_dir, tmp_path_factory.mktemp("tiny_w4") / "family", quant=Quant.W4A16, gptq=None)


@pytest.fixture(scope="session")
def tiny_q16(tiny_hf_dir, tmp_path_factory) -> Path:
    return _export(tiny_hf_dir, tmp_path_factory.mktemp("tiny_q16") / "family")


@pytest.fixture(scope="session")
def tiny_q8(tiny_hf_dir, tmp_path_factory) -> Path:
    return _export(tiny_hf_dir, tmp_path_factory.mktemp("tiny_q8") / "family", kv_bits=KVBits.B8)


@pytest.fixture(scope="session")
def tiny_kv_only(tiny_hf_dir, tmp_path_factory) -> Path:
    return _export(tiny_hf_dir, tmp_path_factory.mktemp("tiny_kv") / "family", quant=Quant.KV_ONLY)


# -- what the ONNX files say, independent of our manifest -----------------------------------------------
def file_boundary(path: Path) -> dict[str, tuple[float, int, str]]:
    """Graph I/O name -> (scale, zero point, integer type) of the DQ reading each integer input and the Q
    writing each integer output, read from the graph's own initializers. Asserts the boundary itself carries
    no Q (on inputs) and no DQ (on outputs): the integers cross it as they are."""
    g = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer if not i.external_data}
    producer = {o: n for n in g.node for o in n.output}
    consumers = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)

    def params(node: onnx.NodeProto) -> tuple[float, int, str]:
        scale, zp = inits[node.input[1]], inits[node.input[2]]
        assert scale.size == 1 and zp.size == 1, f"{node.name}: per-tensor parameters expected"
        return float(scale), int(zp), str(zp.dtype)

    out = {}
    for vi in g.input:
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        if vi.name == "input_ids" or np.dtype(dtype).kind == "f":  # token ids; float inputs of the KV-only variant
            continue
        readers = consumers[vi.name]
        assert readers and all(n.op_type == "DequantizeLinear" for n in readers), \
            f"{path.name}: input {vi.name} ({dtype}) is read by {[n.op_type for n in readers]}"
        found = {params(n) for n in readers}
        assert len(found) == 1, f"{vi.name}: its readers disagree on parameters {found}"
        out[vi.name] = found.pop()
        assert np.dtype(dtype) == np.dtype(out[vi.name][2])
    for vo in g.output:
        if helper.tensor_dtype_to_np_dtype(vo.type.tensor_type.elem_type).kind == "f":
            continue
        writer = producer[vo.name]
        assert writer.op_type == "QuantizeLinear", f"{path.name}: output {vo.name} is written by {writer.op_type}"
        out[vo.name] = params(writer)
        assert helper.tensor_dtype_to_np_dtype(vo.type.tensor_type.elem_type) == np.dtype(out[vo.name][2])
    return out


@pytest.mark.parametrize("family, kv_dtype", [("tiny_q16", "uint16"), ("tiny_q8", "uint8"), ("tiny_kv_only", "uint16")])
def test_kv_boundary_is_integer_and_pairs_share_parameters(family, kv_dtype, request):
    directory = request.getfixturevalue(family)
    graphs = sorted(directory.glob("*.onnx"))
    # a prompt graph and a token graph at each of the two contexts, and the sink graph (not for KV only)
    assert len(graphs) == 2 * 2 + (family != "tiny_kv_only")
    family_params: dict[str, tuple] = {}
    for path in graphs:
        b = file_boundary(path)
        past = {n: p for n, p in b.items() if n.startswith("past_")}
        assert len(past) == 2 * 2 * 2  # layers x KV heads x (K, V)
        for name, p in past.items():
            new = name.replace("past_", "new_", 1)
            assert p[2] == kv_dtype
            assert b[new] == p, f"{path.name}: {name} {p} and {new} {b[new]} differ"
            # One KV buffer serves every graph: its parameters are the family's, not the graph's.
            assert family_params.setdefault(name, p) == p, f"{path.name}: {name} differs from other graphs"
        if family != "tiny_kv_only":  # rope, mask and logits cross the boundary as 16-bit integers too
            for name in ("rope_cos", "rope_sin", "attention_bias", "logits"):
                assert b[name][2] == "uint16", (path.name, name, b[name])
    scales = {p[0] for p in family_params.values()}
    assert len(scales) > 1  # calibrated per tensor, not one default for all


def test_manifest_agrees_with_the_files(tiny_q16):
    from staticlm.runtime.family.contract import kv_tensor_index
    from staticlm.runtime.family.manifest import load_manifest

    m = load_manifest(tiny_q16)
    b = file_boundary(tiny_q16 / m.graphs[0].file)
    for spec in m.graphs[0].inputs:
        if spec.name.startswith("past_"):
            t = m.quant.kv[kv_tensor_index(layer=spec.layer, kv_head=spec.kv_head, is_value="value" in spec.name,
                                           num_kv_heads=m.model.num_kv_heads)]
            assert (np.float32(t.scale), t.zero_point, t.dtype) == (np.float32(b[spec.name][0]), *b[spec.name][1:])


# -- numerics ---------------------------------------------------------------------------------------------
def scored(family: Path, device: DeviceOptions = CPU) -> tuple[Engine, np.ndarray]:
    """TEXT teacher-forced; the 60 rows the 4-row token graph's window holds at context 64 (its last rows are its
    own)."""
    engine = Engine(family, options=EngineOptions(device=device))
    return engine, engine.score(np.frombuffer(TEXT[:TINY_CONTEXTS[-1] - 4], np.uint8).astype(np.int64))


def dequantized_kv(engine: Engine) -> np.ndarray:
    q = engine.kv.valid_block(0)
    return np.stack([t.dequantize(q[i]) for i, t in enumerate(engine.quant.kv)])


def test_kv_only_rounds_each_row_once(tiny_kv_only, tiny_family):
    """Float weights and activations: the stored K/V of the first layer (whose input is exact) must be the
    float family's to within half a quantization step, every row, after a whole teacher-forced text."""
    (q, lq), (f, lf) = scored(tiny_kv_only), scored(tiny_family)
    err = np.abs(dequantized_kv(q) - f.kv.valid_block(0))
    scales = np.array([t.scale for t in q.quant.kv])
    layer0 = 2 * q.config.num_kv_heads
    assert (err[:layer0].max(axis=(1, 2)) <= 0.5 * scales[:layer0] * 1.001).all()
    # Later layers see rounded K/V: a few steps, not a clipped range.
    assert (err.max(axis=(1, 2)) <= 64 * scales).all()
    assert (lq.argmax(1) == lf.argmax(1)).all()


def _activation_scales(path: Path) -> dict[str, float]:
    """Per-tensor scales of the graph's internal QuantizeLinear nodes, by the tensor they quantize."""
    g = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer if i.data_location != onnx.TensorProto.EXTERNAL}
    return {n.input[0]: float(inits[n.input[1]]) for n in g.node
            if n.op_type == "QuantizeLinear" and inits.get(n.input[1], np.zeros(2)).size == 1}


def test_weights_per_channel_with_a_16_bit_head(tiny_q16):
    """Read from the file: projections 8-bit symmetric per output channel, the head 16-bit per vocab column."""
    g = onnx.load(str(tiny_q16 / "prefill_s32_ar4.onnx"), load_external_data=False).graph
    inits = {i.name: i for i in g.initializer}
    dq = {n.input[0]: n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    head, proj = dq["lm_head_t_quantized"], dq["l0.q_quantized"]
    assert inits[head.input[0]].data_type == onnx.TensorProto.INT16
    assert inits[proj.input[0]].data_type == onnx.TensorProto.INT8
    for node in (head, proj):
        columns = inits[node.input[0]].dims[1]
        assert list(inits[node.input[1]].dims) == [columns]  # one scale per output column
        assert not numpy_helper.to_array(inits[node.input[2]]).any()  # symmetric


def test_first_token_runs_alone_in_its_own_sink_graph(tiny_q16):
    """A sequence's first token has activations of its own kind (SmolLM2: massive ones), so it has a graph
    calibrated on first tokens only; every later token runs in graphs calibrated without them."""
    from staticlm.runtime.family.manifest import GraphKind, load_manifest

    manifest = load_manifest(tiny_q16)
    (sink,) = manifest.graphs_of(GraphKind.SINK)
    decode = token_graphs(manifest.graphs_of(GraphKind.PREFILL))[0]  # what decodes every later token
    assert sink.shape.ar == 1 and sink.shape.context == decode.shape.context and sink.file != decode.file
    sink_scales, decode_scales = (_activation_scales(tiny_q16 / g.file) for g in (sink, decode))
    assert sink_scales.keys() == decode_scales.keys() and len(sink_scales) > 50
    assert sum(sink_scales[k] != decode_scales[k] for k in sink_scales) > len(sink_scales) // 2
    engine = Engine(tiny_q16, options=EngineOptions(device=CPU))
    engine.prefill(np.frombuffer(TEXT[:TINY_PREFILL + 3], np.uint8).astype(np.int64))
    assert sink.name in engine._runners and engine.num_cached == TINY_PREFILL + 3


def test_attention_matmuls_take_a_signed_16_bit_second_input(tiny_q16, tiny_q8):
    """Read from the files: HTP takes a MatMul of two uint16 activations with the second one at 8 bits, so that
    one is a symmetric int16 copy holding the uint16 tensor's whole range, in every graph (the sink's following
    the sink's own parameters). An 8-bit KV family's uint8 V is read as it is."""
    for family, expected in ((tiny_q16, 3), (tiny_q8, 0)):  # per KV head: Q^T (K x Q^T, new K x Q^T), past V, new V
        for path in sorted(family.glob("*.onnx")):
            g = onnx.load(str(path), load_external_data=False).graph
            inits = {i.name: numpy_helper.to_array(i) for i in g.initializer if not i.external_data}
            weights = {i.name for i in g.initializer}
            producer = {o: n for n in g.node for o in n.output}
            dynamic = [n for n in g.node if n.op_type == "MatMul" and all(
                producer[i].op_type == "DequantizeLinear" and producer[i].input[0] not in weights for i in n.input)]
            assert len(dynamic) == 4 * 2 * 2, path.name  # scores and attention, past and new, per layer and KV head
            copies = set()
            for node in dynamic:
                first, dq = producer[node.input[0]], producer[node.input[1]]
                scale, zp = inits[dq.input[1]], inits[dq.input[2]]
                if inits[first.input[2]].dtype == np.uint8 or zp.dtype == np.uint8:  # 8-bit KV: as it is
                    assert family is tiny_q8
                    continue
                assert zp.dtype == np.int16 and zp == 0, (path.name, node.name, zp.dtype)
                source = producer[producer[dq.input[0]].input[0]]  # the uint16 tensor's DequantizeLinear
                s16, z16 = float(inits[source.input[1]]), int(inits[source.input[2]])
                assert inits[source.input[2]].dtype == np.uint16
                assert float(scale) * 32767 >= max(z16, 65535 - z16) * s16 * (1 - 1e-6)  # nothing clips
                assert float(scale) <= 2 * s16 * (1 + 1e-6)  # at most one bit coarser
                copies.add(node.input[1])
            assert len(copies) == expected * 2 * 2, (path.name, len(copies))  # layers x KV heads


def _inline_arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
            if i.data_location != onnx.TensorProto.EXTERNAL}


@pytest.mark.parametrize("kv_bits", [KVBits.B16, KVBits.B8])
def test_sink_recalibration_equals_a_second_quantizer_pass(kv_bits, tiny_hf_dir, tmp_path):
    """The sink graph's parameters are rewritten from first-token ranges instead of quantizing again (minutes
    on SmolLM2); ONNX Runtime's quantizer run on the first tokens is the reference, parameter for parameter."""
    import dataclasses

    from staticlm.export.calibration.traces import record_traces
    from staticlm.export.htp import family as qf
    from staticlm.export.sources import load_model
    from staticlm.export.weight_file import WeightFileWriter

    loaded = load_model(tiny_hf_dir)
    options = ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,), htp_style=True,
                            batch_sizes=())
    fm = export_family(loaded, tmp_path / "float", options=options)
    ids, eos, first = qf._prompt_ids(tmp_path / "float", qf.calibration_prompts()[:4])
    traces = record_traces(tmp_path / "float", ids, max_steps=16, max_new_tokens=6, eos_ids=eos, sink_ids=first)
    quant = QuantOptions(calib_steps=16, kv_bits=kv_bits)
    fq = qf.family_quant(traces, quant)

    def quantizer_pass(steps, name: str):
        (tmp_path / name).mkdir()
        shared = qf._SharedInitializers(WeightFileWriter(tmp_path / name / "weights.bin"))
        return qf._quantized_template(tmp_path / "float", fm, work=tmp_path / name, steps=steps, fq=fq, quant=quant,
                                      config=loaded.config, shared=shared)

    template = quantizer_pass(traces.family_steps, "family")
    reference = quantizer_pass(traces.sink_steps, "sink")
    rewritten = qf._sink_template(template, tmp_path / "float", fm, traces.sink_steps, fq=fq, config=loaded.config)
    ref, got, before = (_inline_arrays(t.proto) for t in (reference, rewritten, template))
    assert ref.keys() == got.keys()
    assert [n for n in ref if ref[n].dtype != got[n].dtype or not np.array_equal(ref[n], got[n])] == []
    changed = [n for n in ref if not np.array_equal(ref[n], before[n])]
    assert len(changed) > 50 and all(n.removesuffix("_convert").endswith(("_scale", "_zero_point")) for n in changed)
    assert [(n.op_type, list(n.input)) for n in rewritten.proto.graph.node] == \
        [(n.op_type, list(n.input)) for n in template.proto.graph.node]
    assert dataclasses.replace(rewritten, proto=None, ranges=None) == dataclasses.replace(template, proto=None,
                                                                                           ranges=None)


def test_cpu_emulation_matches_float(tiny_q16, tiny_family):
    """w8a16 on the CPU EP (the HTP numerics): 8-bit weights bound the error near one 8-bit step of each
    tensor's range, i.e. 256 steps of its 16-bit scale; allow 4 such steps."""
    (q, lq), (f, lf) = scored(tiny_q16), scored(tiny_family)
    logits_scale = q.quant.logits.scale
    assert np.abs(lq - lf).max() <= 4 * 256 * logits_scale
    kv_err = np.abs(dequantized_kv(q) - f.kv.valid_block(0)).max(axis=(1, 2))
    scales = np.array([t.scale for t in q.quant.kv])
    assert (kv_err <= 4 * 256 * scales).all(), kv_err / scales
    assert (lq.argmax(1) == lf.argmax(1)).mean() >= 0.95


@pytest.mark.parametrize("family, levels_type", [("tiny_grid", onnx.TensorProto.INT8),
                                                  ("tiny_grid4", onnx.TensorProto.INT4)])
def test_q4_1_source_keeps_its_grid(family, levels_type, request, tiny_hf_dir):
    """Read from the ONNX file: each projection is a blockwise (32 inputs) DequantizeLinear plus 16-bit block
    offsets, and together they give back the gguf package's Q4_1 weights, so no weight was rounded again."""
    from onnx.reference import ReferenceEvaluator

    from staticlm.export.sources import load_model

    directory = request.getfixturevalue(family)
    model = onnx.load(str(directory / "prefill_s64_ar4.onnx"))  # weights loaded from the family's file
    inits = {i.name: i for i in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}

    def weight(name):  # the float value the graph's DequantizeLinear makes of an initializer
        node = next(n for n in dq.values() if n.input[0] == f"{name}_quantized")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if name.endswith(".o") or name.endswith(".down"):
            assert attrs.get("block_size") == 32 and attrs.get("axis") == 0, attrs
            assert inits[node.input[0]].data_type == levels_type
        single = helper.make_model(helper.make_graph(
            [node], "dq", [], [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
            [inits[i] for i in node.input]), opset_imports=[helper.make_opsetid("", 21)])
        return ReferenceEvaluator(single).run(None, {})[0]

    source = {n: _q4_1(w).T for n, w in load_model(tiny_hf_dir).weights.items() if n.endswith("proj.weight")}
    for layer in range(2):
        for ours, theirs in ((f"l{layer}.o", "self_attn.o_proj"), (f"l{layer}.down", "mlp.down_proj")):
            rebuilt = weight(ours) + np.repeat(weight(f"{ours}.block_offsets"), 32, axis=0)
            expected = source[f"model.layers.{layer}.{theirs}.weight"]
            offsets_step = np.abs(expected).max() / 32767 * 4  # the offsets' 16-bit step (offsets reach ~4 max|w|)
            assert np.abs(rebuilt - expected).max() <= offsets_step, np.abs(rebuilt - expected).max()


def test_w4a16_of_a_float_source_rounds_each_block_to_nearest(tiny_w4, tiny_hf_dir):
    """Read from the ONNX file: a float checkpoint's projections become blockwise (32 inputs) int4 with a positive
    scale and zero offset, and every weight lands within half a step of the checkpoint's own value (safetensors,
    not our loader); no block is coarser than one scale per output column would be."""
    from onnx.reference import ReferenceEvaluator
    from safetensors.numpy import load_file

    model = onnx.load(str(tiny_w4 / "prefill_s64_ar4.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    source = {}
    for f in tiny_hf_dir.glob("*.safetensors"):
        source.update(load_file(f))
    for layer in range(2):
        for ours, theirs in ((f"l{layer}.o", "self_attn.o_proj"), (f"l{layer}.down", "mlp.down_proj")):
            node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear"
                        and n.input[0] == f"{ours}_quantized")
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs == {"axis": 0, "block_size": 32}, attrs
            assert inits[node.input[0]].data_type == onnx.TensorProto.INT4
            scales = numpy_helper.to_array(inits[node.input[1]])  # [K/32, N]
            assert (scales > 0).all() and not numpy_helper.to_array(inits[node.input[2]]).any()
            single = helper.make_model(helper.make_graph(
                [node], "dq", [], [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
                [inits[i] for i in node.input]), opset_imports=[helper.make_opsetid("", 21)])
            rebuilt = ReferenceEvaluator(single).run(None, {})[0]
            expected = source[f"model.layers.{layer}.{theirs}.weight"].astype(np.float32).T  # [K, N]
            step = np.repeat(scales, 32, axis=0)
            assert (np.abs(rebuilt - expected) <= step / 2 * (1 + 1e-5)).all()
            per_channel = np.abs(expected).max(axis=0) / 7  # symmetric 4-bit, one scale per output column
            assert (step <= per_channel * (1 + 1e-6)).all() and step.mean() < per_channel.mean()


def _htp_available() -> str | None:
    """None where onnxruntime-qnn imports; otherwise the reason to skip (anything else must fail, not skip)."""
    import importlib

    try:
        importlib.import_module("onnxruntime_qnn")
    except ImportError as e:
        return f"onnxruntime-qnn is not importable on this platform: {e}"
    return None


def _htp_copy(family: Path, tmp_path: Path) -> Path:
    """A copy of the family for the HTP emulator: its compiled contexts go into the copy's cache."""
    reason = _htp_available()
    if reason:
        pytest.skip(reason)
    directory = tmp_path / "family"
    shutil.copytree(family, directory)
    return directory


@pytest.mark.htp
@pytest.mark.parametrize("family", ["tiny_q16", "tiny_q8", "tiny_grid4", "tiny_w4"])
def test_htp_emulator_matches_cpu_ep(family, request, tmp_path):
    """Every node on HTP (CPU fallback disabled: session creation fails otherwise), through the real Engine
    and kv_manager: a prompt chunk, then decode steps; logits within a few 16-bit steps, KV integers within
    a few steps of their own type."""
    directory = _htp_copy(request.getfixturevalue(family), tmp_path)
    ids = np.frombuffer(TEXT, np.uint8).astype(np.int64)
    cpu, htp = (Engine(directory, options=EngineOptions(device=d)) for d in (CPU, HTP))
    worst_logits = 0.0
    for engine in (cpu, htp):
        engine.prefill(ids[:TINY_PREFILL + 3])  # one full chunk and a partial one
    for token in ids[TINY_PREFILL + 3:TINY_PREFILL + 15]:  # teacher-forced, so both follow one path
        a, b = cpu.decode(int(token)), htp.decode(int(token))
        worst_logits = max(worst_logits, float(np.abs(a - b).max()))
    scale = cpu.quant.logits.scale
    assert worst_logits <= 64 * scale, worst_logits / scale
    kv_cpu, kv_htp = (e.kv.valid_block(0).astype(np.int64) for e in (cpu, htp))
    assert kv_cpu.shape == kv_htp.shape and kv_cpu.shape[1] == TINY_PREFILL + 15
    steps = np.abs(kv_cpu - kv_htp)
    if cpu.kv.spec.dtype == "uint16":
        assert steps.max() <= 256, steps.max()  # 1/256 of each tensor's range
    else:
        # Measured on the emulator: K and every prefill row within 1-3 steps, but the V rows of decode
        # steps (an 8-bit output written straight by a 16-bit x 8-bit MatMul) up to 18 steps of 255. The
        # bound keeps the rest tight and holds V to 10 % of its range; the deviation is in the issue note.
        k_rows = steps[0::2]
        assert k_rows.max() <= 3, k_rows.max()
        assert steps[:, :TINY_PREFILL + 3].max() <= 3, steps[:, :TINY_PREFILL + 3].max()
        assert steps.max() <= 26, steps.max()
    assert list((directory / ".qnn_cache").glob("*_ctx.onnx"))  # compiled once, reused by later loads


@pytest.mark.htp
@pytest.mark.parametrize("family", ["tiny_q16", "tiny_q8"])
def test_htp_prompt_chunk_after_the_sink_matches_cpu_ep(family, request, tmp_path):
    """The path a chat prompt takes: its first token alone in the sink graph, then a full prompt chunk, on HTP and
    the CPU EP from the same empty cache. Every KV row the two graphs write within a few integer steps.

    Before the attention MatMuls' second inputs (Q^T, V) became int16 copies (qdq.signed_matmul_operands), HTP
    took them at 8 bits and the uint16 KV rows of the chunk missed these bounds."""
    directory = _htp_copy(request.getfixturevalue(family), tmp_path)
    ids = np.frombuffer(TEXT, np.uint8).astype(np.int64)[:1 + TINY_PREFILL]
    cpu, htp = (Engine(directory, options=EngineOptions(device=d)) for d in (CPU, HTP))
    a, b = cpu.prefill(ids), htp.prefill(ids)
    for engine in (cpu, htp):  # the sink graph, then one prompt-chunk graph (no decode step)
        want = {engine.graphs.sink[0].name, engine.graphs.prefill[0].name}
        assert set(engine._runners) == want, engine._runners.keys()
    logits_steps = np.abs(a - b).max() / cpu.quant.logits.scale
    assert logits_steps <= 32, logits_steps
    kv_cpu, kv_htp = (e.kv.valid_block(0).astype(np.int64) for e in (cpu, htp))
    assert kv_cpu.shape[1] == ids.size
    steps = np.abs(kv_cpu - kv_htp).max(axis=(0, 2))  # per row: the sink's, then the chunk's
    assert steps.max() <= (8 if cpu.kv.spec.dtype == "uint16" else 3), steps


@pytest.mark.htp
def test_compile_writes_one_shared_binary_for_the_family(tiny_q16, tmp_path):
    directory = _htp_copy(tiny_q16, tmp_path)
    proc = staticlm("compile", "--model", directory, "--quiet")
    assert proc.returncode == 0, proc.stderr
    (out,) = (directory / ".qnn_cache").glob("shared.*")
    graphs = sorted(p.stem for p in directory.glob("*.onnx"))
    assert sorted(p.name[:-len("_ctx.onnx")] for p in out.glob("*_ctx.onnx")) == graphs
    (shared,) = out.glob("*.bin")  # N graphs, one context binary: N + 1 files
    # The graphs share their weights in it: each per-graph binary holds the weights again (the tiny family's 7
    # graphs: the shared binary was 0.38 of the per-graph binaries' sum; a copy of the weights per graph would
    # leave it near their sum, since the graphs' own parts do not shrink when they share a binary).
    assert staticlm("compile", "--model", directory, "--per-graph", "--quiet").returncode == 0
    per_graph = [p.stat().st_size for p in (directory / ".qnn_cache").glob("*_ctx_qnn.bin")]
    assert len(per_graph) == len(graphs)
    assert shared.stat().st_size < sum(per_graph) / 2, (shared.stat().st_size, per_graph)


@pytest.mark.htp
def test_compile_gives_each_layer_group_of_a_family_with_parts_its_own_context(tiny_q16, tmp_path, monkeypatch):
    """`export --parts N` is what a model over one HTP context needs: each layer group's parts of every graph
    compile into a context of their own (and a family over the limit compiles only those)."""
    from staticlm.export.parts import add_parts
    from staticlm.runtime.family.manifest import load_manifest
    from staticlm.runtime.session import device

    directory = _htp_copy(tiny_q16, tmp_path)
    add_parts(directory, 2)
    whole, *parts = device.context_groups(directory)
    assert {f.name for f in whole} == {g.file for g in load_manifest(directory).graphs}
    assert len(parts) == 2 and all(f.name.endswith(f".part{k}.onnx") for k, group in enumerate(parts) for f in group)
    assert all(len(group) == len(whole) for group in parts)  # every graph, cut the same way
    monkeypatch.setattr(device, "MAX_CONTEXT_WEIGHT_BYTES", 1)  # weights over one context: the parts alone
    assert device.context_groups(directory) == tuple(parts)
    proc = staticlm("compile", "--model", directory, "--quiet")
    assert proc.returncode == 0, proc.stderr
    contexts = sorted((directory / ".qnn_cache").glob("shared.*"))
    compiled = sorted(tuple(sorted(p.name[:-len("_ctx.onnx")] for p in c.glob("*_ctx.onnx"))) for c in contexts)
    assert compiled == sorted(tuple(sorted(f.stem for f in g)) for g in (whole, *parts))
    assert all(len(list(c.glob("*.bin"))) == 1 for c in contexts)


@pytest.mark.htp
def test_compile_per_graph_contexts_are_what_later_loads_use(tiny_q16, tmp_path):
    """After `compile --per-graph`, an HTP engine compiles nothing: every session comes from a cached context."""
    directory = _htp_copy(tiny_q16, tmp_path)
    assert staticlm("compile", "--model", directory, "--per-graph", "--quiet").returncode == 0
    cache = directory / ".qnn_cache"
    compiled = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    graphs = {p.stem for p in directory.glob("*.onnx")}
    assert {n.split(".")[0] for n in compiled if n.endswith("_ctx.onnx")} == graphs
    engine = Engine(directory, options=EngineOptions(device=HTP))
    engine.load_all()
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == compiled  # nothing new, nothing rewritten


@pytest.mark.htp
def test_compile_graphs_compiles_only_the_graphs_that_match(tiny_q16, tmp_path):
    """`--graphs 'prefill_s32*'`: those graphs' contexts, each reported against the SoC's limit, and no other."""
    directory = _htp_copy(tiny_q16, tmp_path)
    proc = staticlm("compile", "--model", directory, "--per-graph", "--graphs", "prefill_s32*")
    assert proc.returncode == 0, proc.stderr
    decodes = {p.stem for p in directory.glob("prefill_s32*.onnx")}
    assert decodes and len(decodes) < len(list(directory.glob("*.onnx")))
    compiled = {p.name.split(".")[0] for p in (directory / ".qnn_cache").glob("*_ctx.onnx")}
    assert compiled == decodes
    reported = [line for line in proc.stdout.splitlines() if line.startswith("context ")]
    assert sorted(line.split()[1].rstrip(":") for line in reported) == sorted(decodes)
    assert all("bytes of weights of" in line and "(within)" in line for line in reported)


def test_compile_refuses_a_float_family(tiny_family, tmp_path):
    assert_one_line_error(staticlm("compile", "--model", tiny_family), "not an HTP family")
    assert_one_line_error(staticlm("compile", "--model", tmp_path / "none"), "does not exist")


def test_compile_graphs_names_the_graphs_when_none_match(tiny_q16, tmp_path):
    directory = _htp_copy(tiny_q16, tmp_path)
    assert_one_line_error(staticlm("compile", "--model", directory, "--per-graph", "--graphs", "nothing*"),
                          "matches --graphs 'nothing*' (its graphs: prefill_s")
    assert_one_line_error(staticlm("compile", "--model", directory, "--graphs", "prefill_*"), "needs --per-graph")


# -- SmolLM2 on the CPU EP ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_w8a16_agreement(smollm2_loaded, tmp_path):
    """A shortened `staticlm eval`: the smallest family that holds a 300-token window, teacher-forced."""
    from staticlm.apps.commands.eval_metrics import compare, held_out_text
    from staticlm.export.calibration.traces import calibration_prompts
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.runtime.model import open_tokenizer

    options = ExportOptions(contexts=(512,), prefill_len=64, verify_lens=(), batch_sizes=())
    export_family(smollm2_loaded, tmp_path / "float", options=options)
    export_quantized_family(smollm2_loaded, tmp_path / "q", options=options, quant=QuantOptions(calib_steps=32),
                            prompts=calibration_prompts()[:8])  # fewer traces: the export counts toward CI time
    ids = open_tokenizer(tmp_path / "float").encode(held_out_text(), add_special_tokens=False)
    ref, model = (Engine(tmp_path / d, options=EngineOptions(device=CPU)) for d in ("float", "q"))
    result = compare(model, ref, ids, max_tokens=300)
    assert result.num_tokens == 300
    assert result.ppl_change <= 0.05, result
    # The target. Measured 98.7 % (296/300) with the source's Q4_1 grid kept exactly; 97.3 % with
    # per-channel GPTQ weights, 93.7 % with an 8-bit head, 89.7 % before the sink graph.
    assert result.agreement >= 0.97, result


# -- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, fragment", [
    (["--target", "htp", "--quant", "w3a16"], "--quant"),
    (["--target", "htp", "--kv-bits", "4"], "--kv-bits"),
    (["--quant", "w8a16"], "--target htp"),
    (["--kv-bits", "8"], "--target htp"),
])
def test_bad_quant_options(args, fragment, tiny_hf_dir, tmp_path):
    proc = staticlm("export", "--model", tiny_hf_dir, "--out", tmp_path / "out", *args)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("corrupt", [
    lambda q: q.update(kv=q["kv"][:-1]),  # one KV tensor without parameters
    lambda q: q["kv"][0].update(scale=-1.0),
    lambda q: q["logits"].update(zero_point=70000),
    lambda q: q.pop("quant"),
])
def test_corrupted_quantization_block(corrupt, tiny_q16, tmp_path):
    directory = tmp_path / "family"
    shutil.copytree(tiny_q16, directory)
    data = json.loads((directory / "manifest.json").read_text())
    corrupt(data["quantization"])
    (directory / "manifest.json").write_text(json.dumps(data))
    proc = staticlm("generate", "--model", directory, "--prompt", "hi", "--device", "cpu")
    assert_one_line_error(proc, "quantization")


def test_calibration_reaches_the_largest_context_through_trimmed_windows(tiny_hf_dir, tmp_path):
    """Calibration steps cover the positions the family serves (short chats alone stop near their own length),
    a step that keeps only a window's worth of its past feeds that window exactly as the whole past does, and
    the padding rows of a short step repeat its last row."""
    from staticlm.export.calibration.traces import StepFeeds, record_traces, template_entry
    from staticlm.export.htp import family as qf
    from staticlm.export.sources import load_model

    loaded = load_model(tiny_hf_dir)
    contexts = (32, 512)  # the short chats (~130 byte tokens here) reach past the tiny families' 64
    options = ExportOptions(contexts=contexts, prefill_len=TINY_PREFILL, verify_lens=(4,), htp_style=True,
                            batch_sizes=())
    fm = export_family(loaded, tmp_path / "float", options=options)
    ids, eos, _ = qf._prompt_ids(tmp_path / "float", qf.calibration_prompts()[:4])
    template = template_entry(fm.graphs)
    record = dict(max_steps=16, max_new_tokens=6, eos_ids=eos)
    trimmed = record_traces(tmp_path / "float", ids, max_past_rows=template.shape.past_len, **record).family_steps
    whole_traces = record_traces(tmp_path / "float", ids, **record)
    whole = whole_traces.family_steps
    room = max(contexts) - 1
    short_reach = max(map(len, ids)) + record["max_new_tokens"]
    assert short_reach < 0.5 * room and max(s.position for s in trimmed) > 0.75 * room
    assert len({s.position for s in trimmed}) > 8
    assert [s.position for s in trimmed] == [s.position for s in whole]
    assert all(s.past.shape[1] == min(s.position, template.shape.past_len) for s in trimmed)
    assert any(s.position > template.shape.past_len for s in trimmed)
    c = loaded.config
    feeds = StepFeeds(template.inputs, template.shape, config=c, mask_value=-100.0)
    for a, b in zip(trimmed, whole):
        fa, fb = feeds.feeds(a), feeds.feeds(b)
        assert fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)
        if b.position > template.shape.past_len:  # a full window keeps the sink row, then the newest rows
            name, t, _local = feeds._kv[0]
            assert np.array_equal(fa[name][0, 0, 0], b.past[t, 0])
            assert np.array_equal(fa[name][0, 0, 1:], b.past[t, b.position - template.shape.past_len + 1:])

    # Padding rows add nothing to the calibrated ranges: each computes the step's last row exactly, and a
    # decode token's row is what the decode graph (no padding) computes for it.
    import onnxruntime as ort
    decode = max((g for g in fm.graphs if g.shape.ar == 1), key=lambda g: g.shape.past_len)
    decode_feeds = StepFeeds(decode.inputs, decode.shape, config=c, mask_value=-100.0)
    run_template, run_decode = (ort.InferenceSession(str(tmp_path / "float" / g.file)).run for g in (template, decode))
    short = [s for s in trimmed if s.token_ids.size < template.shape.ar]
    assert sum(s.token_ids.size == 1 for s in short) >= 4
    for step in short:
        k = step.token_ids.size
        logits = run_template(["logits"], feeds.feeds(step))[0][0]  # [AR, V]
        assert np.allclose(logits[k:], logits[k - 1], atol=1e-5)
        if k == 1:  # the trimmed past, left-padded into the decode graph's larger window
            alone = run_decode(["logits"], decode_feeds.feeds(step))[0][0, 0]
            assert np.allclose(logits[0], alone, atol=1e-4)


def _kv_outputs(entry, num_kv_heads: int) -> list[tuple[str, int]]:
    from staticlm.runtime.family.contract import KV_OUTPUT_ROLES, kv_tensor_index
    return [(s.name, kv_tensor_index(layer=s.layer, kv_head=s.kv_head, is_value=s.role == KV_OUTPUT_ROLES[1],
                                     num_kv_heads=num_kv_heads)) for s in entry.outputs if s.role in KV_OUTPUT_ROLES]


def test_calibration_replay_chunks_recompute_the_conversation(tiny_hf_dir, tmp_path):
    """GPTQ's extra rows: the long conversation re-read in full chunks from the cache it left. Each chunk, run
    through the widest prefill graph, writes the same K/V rows the engine wrote while decoding them."""
    import onnxruntime as ort

    from staticlm.export.calibration.traces import StepFeeds, record_traces
    from staticlm.export.htp import family as qf
    from staticlm.export.sources import load_model

    loaded = load_model(tiny_hf_dir)
    options = ExportOptions(contexts=(32, 512), prefill_len=TINY_PREFILL, verify_lens=(), htp_style=True,
                            batch_sizes=())
    fm = export_family(loaded, tmp_path / "float", options=options)
    ids, eos, _ = qf._prompt_ids(tmp_path / "float", qf.calibration_prompts()[:4])
    replay = record_traces(tmp_path / "float", ids, max_steps=16, max_new_tokens=6, eos_ids=eos).replay_steps
    assert len(replay) > 0.75 * 511 // TINY_PREFILL
    assert all(s.token_ids.size == TINY_PREFILL and s.past.shape[1] == s.position for s in replay)
    assert [s.position for s in replay] == list(range(1, replay[-1].position + 1, TINY_PREFILL))
    prefill = max((g for g in fm.graphs if g.shape.ar == TINY_PREFILL), key=lambda g: g.shape.past_len)
    c = loaded.config
    feeds = StepFeeds(prefill.inputs, prefill.shape, config=c, mask_value=-100.0)
    run = ort.InferenceSession(str(tmp_path / "float" / prefill.file)).run
    outputs = _kv_outputs(prefill, c.num_kv_heads)
    for step, later in zip(replay, replay[1:]):  # the later step's past holds what the engine wrote for this one
        written = later.past[:, step.position:step.position + TINY_PREFILL]  # [T, AR, D]
        new = run([n for n, _ in outputs], feeds.feeds(step))
        for (_, t), rows in zip(outputs, new):  # rows [1, 1, AR, D]
            assert np.allclose(rows[0, 0], written[t], atol=1e-4)
