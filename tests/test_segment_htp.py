"""Segment KV on the HTP target (issue 25, Part A): segmented batched graphs of static shapes, quantized once as a
template (export/htp/segment_export.py), run by the same SegmentEngine as the cpu target's.

References: the same family's single-sequence graphs (another graph builder, runner and KV layout), run on each
sequence alone with the same tokens; the graphs' own files for their boundary parameters; a naive mask.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import TINY_CONTEXTS, TINY_PREFILL
from test_htp import CPU, HTP, TEXT, _htp_copy, file_boundary

from staticlm.export.htp.qdq import SIGNED_OPERAND
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.family.contract import Role
from staticlm.runtime.family.manifest import GraphKind, load_manifest
from staticlm.runtime.family.quant_params import KVBits, Quant

IDS = np.frombuffer(TEXT, np.uint8).astype(np.int64)
NUM_PROMPT = 11


@pytest.fixture(scope="module")
def families(tiny_hf_dir, tmp_path_factory) -> dict[str, Path]:
    """w8a16 with 16-bit and 8-bit KV, and w4a16 (round-to-nearest); batch 4 (the default export's batched size)."""
    from staticlm.export.family import ExportOptions
    from staticlm.export.htp.family import export_quantized_family
    from staticlm.export.htp.options import QuantOptions
    from staticlm.export.sources import load_model

    root = tmp_path_factory.mktemp("htp_segments")
    options = ExportOptions(contexts=TINY_CONTEXTS, prefill_len=TINY_PREFILL, verify_lens=(4,), batch_sizes=(4,))
    out = {}
    for name, quant in (("kv16", {}), ("kv8", {"kv_bits": KVBits.B8}), ("w4", {"quant": Quant.W4A16, "gptq": None})):
        export_quantized_family(load_model(tiny_hf_dir), root / name, options=options,
                                quant=QuantOptions(calib_steps=24, **quant))
        out[name] = root / name
    return out


def _engine(family: Path, device=CPU) -> Engine:
    return Engine(family, options=EngineOptions(device=device))


def test_segmented_graphs_bind_the_single_graphs_kv_as_it_is(families):
    # Read from the files: every prompt, response and new-row tensor carries exactly the parameters of the single
    # decode graph's past/new tensor (no requantization between the two), and each KV input feeds only the
    # attention products through its DequantizeLinear: nothing copies or transposes a window.
    family = families["kv16"]
    manifest = load_manifest(family)
    graphs = manifest.graphs_of(GraphKind.SEGMENT, batch=4)
    # decode and the verify length 4 x prompt rungs 31, 63 (the decode windows) x response rungs 16, 64 (16 x 4^k,
    # then the largest context)
    assert sorted((g.shape.ar, g.shape.past_len, next(s.shape[2] for s in g.inputs if s.role is Role.PROMPT_KEY))
                  for g in graphs) == [(ar, p, pp) for ar in (1, 4) for p in (16, 64) for pp in (31, 63)]
    single = file_boundary(family / manifest.graphs_of(GraphKind.DECODE)[0].file)
    for entry in graphs:
        seg = file_boundary(family / entry.file)
        kv = [s for s in entry.inputs + entry.outputs if s.role in (Role.PROMPT_KEY, Role.PROMPT_VALUE, Role.PAST_KEY,
                                                                      Role.PAST_VALUE, Role.NEW_KEY, Role.NEW_VALUE)]
        assert len(kv) == 8 * (2 + 4)
        for s in kv:
            twin = s.name.replace("prompt_", "past_")
            twin = twin.rsplit("_s", 1)[0] if s.role in (Role.NEW_KEY, Role.NEW_VALUE) else twin
            assert seg[s.name] == single[twin], s.name
            assert seg[s.name][2] == s.dtype == "uint16"
        g = onnx.load(str(family / entry.file), load_external_data=False).graph
        consumers = {}
        for n in g.node:
            for i in n.input:
                consumers.setdefault(i, []).append(n)
        for s in entry.inputs:
            if s.role in (Role.PROMPT_KEY, Role.PROMPT_VALUE, Role.PAST_KEY, Role.PAST_VALUE):
                (dq,) = consumers[s.name]
                readers = consumers[dq.output[0]]
                for q in [n for n in readers if n.op_type == "QuantizeLinear"]:  # V: the single graphs' int16 copy
                    assert q.output[0].endswith(SIGNED_OPERAND)  # (qdq.signed_matmul_operands), then MatMul only
                    readers = [n for n in readers if n is not q] + consumers[consumers[q.output[0]][0].output[0]]
                assert dq.op_type == "DequantizeLinear" and {n.op_type for n in readers} == {"MatMul"}, s.name


def _teacher_forced(family: Path, streams: np.ndarray):
    """The segmented engine and 4 single-sequence engines over the same tokens; their logits [steps, B, V] and the
    response rows they wrote [B, T, n, D]."""
    from staticlm.runtime.engine.segment_engine import SegmentEngine

    prompt = IDS[:NUM_PROMPT]
    source = _engine(family)
    source.prefill(prompt)
    seg = SegmentEngine.beside(source, batch=4)
    seg.load_prefix(source)
    alone = [_engine(family) for _ in range(4)]
    for e in alone:
        e.prefill(prompt)
    got, want = [], []
    for step in range(streams.shape[1]):
        got.append(seg.decode_batch(streams[:, step], active=np.ones(4, bool)).copy())
        want.append(np.stack([e.decode(int(t)) for e, t in zip(alone, streams[:, step])]))
    rows = np.stack([seg.kv.valid_block(b) for b in range(4)]).astype(np.int64)
    ref_rows = np.stack([e.kv.valid_block(0)[:, NUM_PROMPT:] for e in alone]).astype(np.int64)
    return seg, np.stack(got), np.stack(want), rows, ref_rows


@pytest.mark.parametrize("name", ["kv16", "kv8", "w4"])
def test_segmented_steps_match_each_sequence_alone(families, name):
    # 4 different continuations, teacher-forced for 36 steps: the response buffer climbs from rung 16 to 64.
    # The segmented template is calibrated apart from the single graphs' one (other tensors, other ranges), so the
    # two agree within quantization tolerance, not exactly. Measured: logits within 7 (16-bit KV, w8a16 and w4a16)
    # and 30 (8-bit KV) steps of the logits' 16-bit scale, mean KV row difference 0.04 % (0.09 % with 8-bit KV) of
    # the range (bounds: 64 steps, 0.5 %); every argmax equal.
    family = families[name]
    streams = np.stack([IDS[NUM_PROMPT + 5 * b:NUM_PROMPT + 5 * b + 36] for b in range(4)])
    seg, got, want, rows, ref_rows = _teacher_forced(family, streams)
    assert seg.kv.capacity == 64 and seg.kv.stats.num_allocations == 2  # 16, then 64
    scale = seg.family.quant.logits.scale
    assert np.abs(got - want).max() <= 64 * scale, np.abs(got - want).max() / scale
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert rows.shape == ref_rows.shape == (4, 8, 36, 16)
    levels = np.iinfo(np.dtype(seg.kv.spec.dtype)).max
    assert np.abs(rows - ref_rows).mean() <= 0.005 * levels
    assert seg.segments.prompt.stats.copied_rows == 0  # the prompt is read where it was prefilled


def test_greedy_responses_equal_single_runs(families):
    # --num-responses 4 with shared prompt KV on the HTP family: every response is the single run's.
    from test_segment_kv import _batch_generate, _single_tokens, _varied_greedy

    from staticlm.runtime.engine.segment_engine import SegmentEngine
    from staticlm.runtime.generate.text_stream import GenerationParams

    family = families["kv16"]
    ids = list(IDS[:9])
    params = GenerationParams(max_new_tokens=40, ignore_eos=True, sampling=_varied_greedy())
    gen, responses = _batch_generate(family, ids, params, segments=True)
    assert isinstance(gen.engine, SegmentEngine) and gen.engine.kv.capacity == 64
    want = _single_tokens(family, ids, params)
    assert len(set(want)) > 10
    assert [r.token_ids for r in responses] == [want] * 4
    # without --shared-prompt-kv too: the HTP family's batched graphs are all segmented
    from conftest import model_of

    model = model_of(_engine(family))
    assert [r.token_ids for r in model.generate_many(ids, params, num_responses=2)] == [want] * 2
    assert isinstance(model.loop.rows.engine, SegmentEngine)


def test_response_cache_takes_only_the_graphs_rungs():
    from staticlm.kv_manager import ContextFull, KVSpec
    from staticlm.kv_manager.segments import ResponseCache, segment_bias

    spec = KVSpec(num_tensors=4, head_dim=2, dtype="uint16", max_past=100, max_ar=1, max_positions=512, batch=2,
                  pad_values=(7, 7, 9, 9))
    cache = ResponseCache(spec, rungs=(16, 32, 64))
    capacities = []
    for _ in range(40):
        cache.prepare(past_len=max(16, -(-int(cache.lengths.max()) // 16) * 16), ar=1)
        capacities.append(cache.capacity)
        cache.advance(np.array([1, 0]))
    assert sorted(set(capacities)) == [16, 32, 64] and capacities.index(32) == 16 and capacities.index(64) == 32
    assert cache.buffers()[2].shape == (2, 1, 64, 2) and (cache.buffers()[2] == 9).all()  # never written: padding
    cache.lengths[0] = cache.ends[0] = 64
    with pytest.raises(ContextFull):
        cache.prepare(past_len=64, ar=1)

    bias = segment_bias(num_prompt=3, prompt_len=5, lengths=np.array([2, 0]), past_len=4, ar=1,
                        out=np.zeros((2, 1, 1, 10), np.float32))
    allowed = bias == 0
    want = np.zeros((2, 1, 1, 10), bool)
    want[:, 0, 0, 2:5] = True  # the prompt's 3 rows at the right end of its 5-row window
    want[0, 0, 0, 5:7] = True  # sequence 0's 2 response rows, sequence 1 has none
    want[:, 0, 0, 9] = True  # the new row
    np.testing.assert_array_equal(allowed, want)


@pytest.mark.htp
def test_htp_emulator_runs_a_segmented_graph(families, tmp_path):
    """The whole path on the HTP emulator (CPU fallback disabled): the prompt prefilled there, then segmented decode
    steps; logits and the response rows against the CPU EP's. Measured: logits within 16 steps, response rows
    within 113 of 65535 (test_htp's bounds for the single graphs: 64 and 256)."""
    from staticlm.runtime.engine.segment_engine import SegmentEngine

    directory = _htp_copy(families["kv16"], tmp_path)
    streams = np.stack([IDS[NUM_PROMPT + 5 * b:NUM_PROMPT + 5 * b + 6] for b in range(4)])
    out = {}
    for name, device in (("cpu", CPU), ("htp", HTP)):
        source = _engine(directory, device)
        source.prefill(IDS[:NUM_PROMPT])
        seg = SegmentEngine.beside(source, batch=4)
        seg.load_prefix(source)
        logits = np.stack([seg.decode_batch(streams[:, i], active=np.ones(4, bool)).copy()
                           for i in range(streams.shape[1])])
        out[name] = logits, np.stack([seg.kv.valid_block(b) for b in range(4)]).astype(np.int64)
    scale = source.quant.logits.scale
    assert np.abs(out["cpu"][0] - out["htp"][0]).max() <= 64 * scale
    assert (out["cpu"][0].argmax(-1) == out["htp"][0].argmax(-1)).all()
    assert np.abs(out["cpu"][1] - out["htp"][1]).max() <= 256
    assert list((directory / ".qnn_cache").glob("segment_*_ctx.onnx"))  # compiled for HTP, not run on the CPU


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_float_segmented_graph_equals_each_sequence_alone(arch, tmp_path):
    # The graph's math without quantization, on architectures with q/k biases (qwen2), q/k norms (qwen3) and partial
    # rotary (phi3): the float segmented graph, fed by hand (its own naive response buffers, a hand-made mask), gives
    # each sequence the logits and K/V rows of the float single-sequence graphs running it alone.
    import onnxruntime as ort
    import tiny_archs

    from staticlm.export.family import ExportOptions, export_family
    from staticlm.export.htp.segment_graph import FamilyWeights, HTPSegmentGraph
    from staticlm.export.sources import load_model
    from staticlm.runtime.engine.rope import RopeTable
    from staticlm.runtime.family.contract import GraphShape

    tiny_archs.build(arch, tmp_path / "hf")
    family = tmp_path / "family"
    fm = export_family(load_model(tmp_path / "hf"), family, options=ExportOptions(
        contexts=(32,), prefill_len=TINY_PREFILL, verify_lens=(), batch_sizes=(), htp_style=True))
    config, decode = fm.model, fm.graphs_of(GraphKind.DECODE)[0]
    b, pp, p, d, num_layers, hkv = 4, decode.shape.past_len, 16, fm.model.head_dim, config.num_layers, \
        config.num_kv_heads
    weights = FamilyWeights(onnx.load(str(family / decode.file), load_external_data=False))
    proto = HTPSegmentGraph(config, GraphShape(b, 1, p), prompt_len=pp, weights=weights).build("segment")
    onnx.save_model(proto, family / "segment.onnx")
    session = ort.InferenceSession(str(family / "segment.onnx"), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]

    source = Engine(family, options=EngineOptions(device=CPU))
    source.prefill(IDS[:NUM_PROMPT])
    alone = [Engine(family, options=EngineOptions(device=CPU)) for _ in range(b)]
    for e in alone:
        e.prefill(IDS[:NUM_PROMPT])
    rope = RopeTable(config)
    buffers = np.zeros((num_layers, hkv, 2, b, 1, p, d), np.float32)  # [L, Hkv, K|V, B, 1, P, D]
    for step in range(3):
        tokens = np.array([IDS[NUM_PROMPT + 7 * s + step] for s in range(b)])
        cos, sin = np.zeros((2, b, 1, 1, d), np.float32)
        rope.fill(np.full((b, 1), NUM_PROMPT + step), cos_out=cos, sin_out=sin)
        bias = np.full((b, 1, 1, pp + p + 1), -1e9, np.float32)
        bias[..., pp - NUM_PROMPT:pp + step] = 0  # the prompt at the window's right end, then `step` own rows
        bias[..., -1] = 0
        feeds = {"input_ids": tokens[:, None], "rope_cos": cos, "rope_sin": sin, "attention_bias": bias}
        for layer in range(num_layers):
            for h in range(hkv):
                for kv, (prompt, past) in enumerate((("prompt_key", "past_key"), ("prompt_value", "past_value"))):
                    t = (layer * hkv + h) * 2 + kv
                    feeds[f"{prompt}_{layer}_h{h}"] = source.kv.window(t, 0, pp)  # [1, 1, Pp, D]
                    feeds[f"{past}_{layer}_h{h}"] = buffers[layer, h, kv]
        got = dict(zip(outputs, session.run(outputs, feeds)))
        for s in range(b):
            want = alone[s].decode(int(tokens[s]))
            np.testing.assert_allclose(got["logits"][s, 0], want, atol=1e-4 * np.abs(want).max(), err_msg=arch)
            for layer in range(num_layers):
                for h in range(hkv):
                    for kv, role in enumerate(("key", "value")):
                        row = got[f"new_{role}_{layer}_h{h}_s{s}"][0, 0, 0]  # [D]
                        want_row = alone[s].kv.valid_rows((layer * hkv + h) * 2 + kv, 0)[-1]
                        np.testing.assert_allclose(row, want_row, atol=1e-5, err_msg=f"{arch} {role} {layer} {h}")
                        buffers[layer, h, kv, s, 0, step] = row


def test_bass_runs_on_the_segmented_verify_graphs(families):
    # --speculate with --num-responses 4 (BASS-PAD) on the HTP family: its segmented verify graphs (AR 4, drafts cut
    # to 3 tokens) accept drafts, and every response is still the plain greedy single run's.
    from test_segment_kv import _batch_generate, _single_tokens

    from staticlm.runtime.generate.text_stream import GenerationParams
    from staticlm.runtime.model import open_tokenizer

    family = families["kv16"]
    assert {g.shape.ar for g in load_manifest(family).graphs_of(GraphKind.SEGMENT, batch=4)} == {1, 4}
    ids = open_tokenizer(family).encode("abcabcabcabc abcabc", add_special_tokens=False)
    params = GenerationParams(max_new_tokens=30, ignore_eos=True)  # plain greedy repeats: lookup drafts find matches
    gen, responses = _batch_generate(family, ids, params, segments=True, speculate=True)
    assert gen.speculator.stats.num_accepted > 0 and gen.engine.counters.num_verify_steps > 0
    assert [r.token_ids for r in responses] == [_single_tokens(family, ids, params)] * 4


def test_what_the_segmented_graphs_cannot_serve_is_a_user_error(families, tmp_path):
    # No verify graphs (exported with --verify-lens none), and a sliding prompt has no fixed segment: one-line user
    # errors, not a batched engine that fails on its first step.
    from conftest import model_of

    from staticlm.errors import UserError
    from staticlm.kv_manager import Overflow
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    family = tmp_path / "decode_only"  # the family as `--verify-lens none` writes it: no segmented verify graphs
    shutil.copytree(families["kv16"], family)
    manifest = load_manifest(family)
    manifest = dataclasses.replace(manifest, graphs=tuple(g for g in manifest.graphs
                                                          if g.kind is not GraphKind.SEGMENT or g.shape.ar == 1))
    manifest.save(family)
    speculating = Model(_engine(family), options=RunOptions(speculate="lookup", shared_prompt_kv=True))
    with pytest.raises(UserError, match="no verify length"):
        speculating.generate_many([5, 6, 7], num_responses=4)
    sliding = model_of(Engine(family, options=EngineOptions(device=CPU, overflow=Overflow.SLIDE)))
    with pytest.raises(UserError, match="on-overflow slide"):
        sliding.generate_many([5, 6, 7], num_responses=4)


def test_requests_sharing_a_cached_prefix_read_its_static_window_in_place(families):
    # The HTP layout binds the prompt segment as a static window ending at the segment's last row, while the lane
    # (pointer windows) prefills the newcomer's rest after it: every answer is still its single run's.
    from conftest import model_of
    from test_segment_kv import _run_requests, _single_tokens, _varied_greedy

    from staticlm.runtime.generate.admission import MIN_SHARED_PREFIX
    from staticlm.runtime.generate.loop import GenerationLoop
    from staticlm.runtime.generate.text_stream import GenerationParams

    family = families["kv16"]
    shared = [int(t) for t in IDS[:MIN_SHARED_PREFIX]]
    prompts = [shared + [int(t) for t in IDS[40:43]], shared + [int(t) for t in IDS[50:55]]]
    params = GenerationParams(max_new_tokens=20, ignore_eos=True, sampling=_varied_greedy())
    want = [_single_tokens(family, ids, params) for ids in prompts]
    for submit_after in ([0, 0], [0, 3]):
        loop = GenerationLoop(model_of(_engine(family)).loop_parts(), eager=True)
        assert loop.rows.kind == "segments"
        got, seen = _run_requests(loop, prompts, params, submit_after=submit_after)
        assert got == want, submit_after
        together = [step for step in seen if len(step) == 2]
        assert together and all(num_segment == len(shared) for step in together for num_segment, *_ in step)
