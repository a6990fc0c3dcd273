"""Segment KV (seed 004, section 3.2): the prompt's K/V shared by every response of --num-responses.

References: formula (3) and the copy-based layout's row count for the memory; for the graphs, the copy-based
batched engine (every row holds its own copy of the prompt) and single-sequence runs of the same family.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS, TINY_CONTEXTS, TINY_PREFILL

from staticlm.kv_manager import KVSpec, make_kv_cache
from staticlm.kv_manager.segments import ResponseCache, SegmentKV, copied_kv_rows, segment_kv_rows, token_bytes
from staticlm.runtime import kernels


# -- kv_manager: formula (3) -----------------------------------------------------------------------------
def test_segment_layout_holds_formula_3_bytes_and_keeps_every_row():
    # The seed's figures: n = 4 responses of 128 tokens to a 1,000-token prompt hold 1,512 rows, against
    # 4,512 when every response has its own copy of the prompt.
    num_prompt, num_responses, response_len = 1000, 4, 128
    spec = dict(num_tensors=4, head_dim=2, dtype="float32", max_ar=1, max_positions=4096)
    prompt = make_kv_cache(KVSpec(max_past=2047, **spec))
    prompt.load(0, np.random.default_rng(0).standard_normal((4, num_prompt, 2)).astype(np.float32))
    responses = ResponseCache(KVSpec(max_past=2047 - num_prompt, batch=num_responses, heads_per_buffer=2, **spec))
    layout = SegmentKV(prompt, responses)
    written = np.zeros((num_responses, response_len, 4, 2), np.float32)  # [B, step, T, D] what each step wrote
    for step in range(response_len):
        responses.prepare(past_len=max(16, -(-step // 16) * 16), ar=1)
        for t in range(4):
            for b in range(num_responses):
                row = responses.slot(t, b, 1)  # [1, 1, 1, D]
                row[...] = written[b, step, t] = [b * 1000 + step, t]
        responses.advance(1)
    assert segment_kv_rows(num_prompt=num_prompt, num_responses=num_responses, response_len=response_len) == 1512
    assert copied_kv_rows(num_prompt=num_prompt, num_responses=num_responses, response_len=response_len) == 4512
    assert layout.kv_bytes == 1512 * token_bytes(prompt.spec)
    assert responses.stats.num_allocations == response_len // 16  # one buffer per 16 rows, as the seed grows it
    for b in range(num_responses):  # every row survived the reallocations
        for t in range(4):
            np.testing.assert_array_equal(responses.valid_rows(t, b), written[b, :, t])
    np.testing.assert_array_equal(prompt.valid_rows(3, 0), prompt.valid_block(0)[3])

    copy = make_kv_cache(KVSpec(max_past=2047, batch=num_responses, **spec))
    for b in range(num_responses):
        copy.load(b, prompt.valid_block(0))
    for _ in range(response_len):
        copy.prepare(past_len=2047, ar=1)
        copy.advance(1)
    held = int(copy.lengths.sum()) * token_bytes(copy.spec)
    assert held == 4512 * token_bytes(prompt.spec)
    assert layout.kv_bytes <= 0.4 * held  # the target


@pytest.mark.parametrize("strategy", ["pointer", "bmc", "shift", "concat", "in_place"])
def test_a_prompt_segment_is_the_caches_first_rows_while_it_appends_and_rewinds_after_them(strategy):
    # The segment's windows are read at addresses: after every append, rewind and compaction of the rows after the
    # segment, they still end at its last row and hold its rows, as the cache's own valid rows say.
    import ctypes

    from staticlm.kv_manager import Strategy

    spec = KVSpec(num_tensors=3, head_dim=2, dtype="float32", max_past=15, max_ar=4, max_positions=100)
    prompt = make_kv_cache(spec, Strategy(strategy), bmc_r=3)
    rng = np.random.default_rng(2)
    prompt.load(0, rng.standard_normal((3, 6, 2)).astype(np.float32))
    responses = ResponseCache(KVSpec(num_tensors=3, head_dim=2, dtype="float32", max_past=9, max_ar=1,
                                     max_positions=100, heads_per_buffer=1))
    layout = SegmentKV(prompt, responses, num_prompt_rows=4)
    want = prompt.valid_block(0)[:, :4].copy()  # [T, 4, D]
    for num_new in (3, 4, 2, 4, 1, 4, 4):  # appends after the segment, rewinds to it, compactions on the way
        prompt.prepare(past_len=15, ar=4)
        for t in range(3):
            prompt.slot(t, 0, 4)[...] = rng.standard_normal((1, 1, 4, 2))
        prompt.advance(num_new)
        for rows in (4, 6):  # the segment's own rows, and a static window with 2 rows of left padding before them
            for t, address in enumerate(layout.prompt_addresses(rows).tolist()):
                window = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)),
                                               shape=(rows, 2))  # [rows, D] what a graph bound there reads
                np.testing.assert_array_equal(window[rows - 4:], want[t])
        prompt.rewind(min(int(prompt.lengths[0]) - 4, 4))
    assert int(prompt.lengths[0]) >= 4


# -- graphs and runs on a tiny family ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def families(tiny_hf_dir, tmp_path_factory) -> dict[str, Path]:
    """The cpu target's default (GroupQueryAttention, in place) and its per-head windows, batch 4, verify 4; a
    256-token context holds the bench's 100-token prompt."""
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.graph import CpuAttention, CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model

    root = tmp_path_factory.mktemp("segments")
    out = {}
    variants = [("gqa", CpuAttention.GQA, "float32"), ("windows", CpuAttention.WINDOWS, "float32"),
                ("gqa-float16", CpuAttention.GQA, "float16")]
    if kernels.available():  # staticlm's CachedAttention and SegmentAttention
        variants += [("staticlm", CpuAttention.GQA, "float32"), ("staticlm-float16", CpuAttention.GQA, "float16")]
    for name, attention, kv in variants:
        cpu = CpuOptions(attention=attention, kv_dtype=kv, staticlm_attention=name.startswith("staticlm"))
        export_cpu_family(load_model(tiny_hf_dir), root / name, cpu=cpu,
                          options=ExportOptions(contexts=(TINY_CONTEXTS[0], 256), prefill_len=TINY_PREFILL,
                                                verify_lens=(4,), batch_sizes=(4,)))
        out[name] = root / name
    return out


def test_segmented_graphs_read_both_segments_in_place(families):
    # Every KV input (the prompt's per-head windows, the response buffers) feeds only the products of attention:
    # no Concat, Slice, Transpose or Expand copies KV. The prompt's and the responses' lengths are symbolic.
    import onnx

    for name in ("segment_ar1_b4", "segment_ar4_b4"):
        model = onnx.load(str(families["gqa"] / f"{name}.onnx"), load_external_data=False)
        kv_inputs = {i.name: i for i in model.graph.input if i.name.startswith(("prompt_", "past_"))}
        lengths = {i.type.tensor_type.shape.dim[0 if n.startswith("prompt_") else 2].dim_param
                   for n, i in kv_inputs.items()}
        assert lengths == {"prompt_len", "past_len"}
        readers = {n: [node.op_type for node in model.graph.node if n in node.input] for n in kv_inputs}
        for n, ops in readers.items():
            assert ops and set(ops) <= {"FusedMatMul", "MatMul", "Shape"}, (name, n, ops)
        # one prompt window per (layer, KV head, K|V), one response buffer per (layer, K|V): 2 layers, 2 heads
        num_prompt = sum(n.startswith("prompt_") for n in kv_inputs)
        assert (num_prompt, len(kv_inputs) - num_prompt) == (8, 4)


def _engine(family: Path):
    from staticlm.runtime.engine.engine import Engine, EngineOptions
    from staticlm.runtime.session.device import Device, DeviceOptions

    return Engine(family, options=EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=THREADS)))


@pytest.mark.parametrize("name", ["gqa", "windows", "gqa-float16", "staticlm", "staticlm-float16"])
def test_segmented_steps_match_single_sequence_runs(families, name):
    # Decode steps across two 16-row rungs of the response ladder, a verify step, then ragged commits: every
    # sequence's logits equal the same tokens scored alone (the prompt in its own cache, no batch at all).
    from staticlm.runtime.engine.segment_engine import SegmentEngine

    if name not in families:
        pytest.skip(f"staticlm's attention ops: {kernels.why_missing()}")
    family = families[name]
    prompt = np.random.default_rng(5).integers(0, 256, 11)
    single = _engine(family)
    single.prefill(prompt)
    seg = SegmentEngine.beside(single, batch=4)
    seg.load_prefix(single)
    history = [list(prompt) for _ in range(4)]

    # GroupQueryAttention computes in its cache's type: over float16 KV, the single runs' scores and probabilities
    # are rounded to float16 (2^-11 relative), the segmented graphs' in float32
    tolerance = 2e-3 if name == "gqa-float16" else 1e-3

    def check(got: np.ndarray, rows: list[list[int]]) -> None:
        for b in range(4):
            want = _engine(family).score(np.array(history[b] + rows[b]))[-len(rows[b]):]
            np.testing.assert_allclose(got[b, :len(rows[b])], want, atol=tolerance * np.abs(want).max(),
                                       err_msg=f"{b}")
            assert (got[b, :len(rows[b])].argmax(-1) == want.argmax(-1)).all()

    streams = np.random.default_rng(6).integers(0, 256, (4, 18))
    for step in range(18):
        logits = seg.decode_batch(streams[:, step], active=np.ones(4, bool))
        if step in (0, 15, 16, 17):  # the first rung, its last row, the second rung
            check(logits[:, None], [[int(t)] for t in streams[:, step]])
        for b in range(4):
            history[b].append(int(streams[b, step]))
    drafts = np.random.default_rng(7).integers(0, 256, (4, 4))
    check(seg.verify(drafts).copy(), [list(map(int, d)) for d in drafts])
    accepted = np.array([1, 4, 0, 2])
    seg.commit(accepted)
    for b in range(4):
        history[b] += list(map(int, drafts[b, :accepted[b]]))
    nxt = np.array([3, 4, 5, 6])
    check(seg.decode_batch(nxt, active=np.ones(4, bool))[:, None], [[int(t)] for t in nxt])
    assert seg.kv.stats.copied_rows == 4 * 16  # the responses' rows, copied once when they passed 16 rows
    assert single.kv.stats.copied_rows == 0  # and never the prompt


def _through_the_protocol(engine, source, streams: np.ndarray) -> list[np.ndarray]:
    """Decode steps (the last with a row idle), a verify, ragged commits and a decode after them, using only what
    BatchEngine names; every step's logits [B, n, V]."""
    out = []
    engine.warm_up(verify=True)
    engine.load_prefix(source)
    for step in range(streams.shape[1]):
        active = np.array([True, True, True, step < streams.shape[1] - 1])
        out.append(engine.decode_batch(streams[:, step], active=active)[:, None].copy())
    assert engine.verify_len(4) == 4 and engine.verify_len(5) is None
    out.append(engine.verify(np.arange(16).reshape(4, 4) + 7).copy())
    engine.commit(np.array([1, 4, 0, 2]))
    out.append(engine.decode_batch(np.array([3, 4, 5, 6]), active=np.ones(4, bool))[:, None].copy())
    assert engine.verify_cost_ratio(4) > 0 and engine.counters.num_decode_steps == streams.shape[1] + 1
    return out


def test_both_batched_engines_are_batch_engines_that_answer_alike(families):
    # The batched Engine (a copy of the prompt per row) and SegmentEngine (the prompt read in place) driven through
    # BatchEngine alone give the same logits, and the last step's equal each sequence's tokens scored alone.
    from staticlm.runtime.engine.batch_engine import BatchEngine
    from staticlm.runtime.engine.engine import Engine
    from staticlm.runtime.engine.segment_engine import SegmentEngine

    family = families["gqa"]
    prompt = np.random.default_rng(10).integers(0, 256, 11)
    single = _engine(family)
    single.prefill(prompt)
    copied = Engine(family, options=single.options, batch=4, weights_from=single)
    segmented = SegmentEngine.beside(single, batch=4)
    assert isinstance(copied, BatchEngine) and isinstance(segmented, BatchEngine)
    assert not isinstance(single.kv, BatchEngine)  # the check tells things apart
    assert copied.max_context == segmented.max_context == single.max_context
    streams = np.random.default_rng(11).integers(0, 256, (4, 3))
    runs = {name: _through_the_protocol(e, single, streams) for name, e in (("copied", copied),
                                                                           ("segmented", segmented))}
    for got, want in zip(runs["segmented"], runs["copied"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max())
    history = [list(prompt) + list(streams[b, :3 if b < 3 else 2]) + list(range(7 + 4 * b, 7 + 4 * b + n))
               for b, n in enumerate([1, 4, 0, 2])]
    for b, token in enumerate([3, 4, 5, 6]):
        want = _engine(family).score(np.array(history[b] + [token]))[-1]
        np.testing.assert_allclose(runs["segmented"][-1][b, 0], want, atol=1e-3 * np.abs(want).max())
    # the prompt once and the responses' buffer, against a whole cache per row
    assert 0 < segmented.kv_bytes < copied.kv_bytes == copied.kv.stats.reserved_bytes
    first = runs["copied"][0]
    for engine in (copied, segmented):  # reset, then the same prompt again: the same first step
        engine.reset()
        engine.load_prefix(single)
        np.testing.assert_allclose(engine.decode_batch(streams[:, 0], active=np.ones(4, bool))[:, None], first,
                                   atol=1e-3 * np.abs(first).max())


def _varied_greedy():
    from staticlm.runtime.generate.sampling import SamplingParams

    # greedy; the tiny random model repeats one token forever unless repeating is penalized hard
    return SamplingParams(temperature=0.0, repetition_penalty=10.0)


def _batch_generate(family: Path, ids: list[int], params, *, segments: bool, num_responses: int = 4,
                    speculate: bool = False):
    """The generation loop's rows of one kind, and the answers it gave (with BASS over lookup drafts)."""
    from conftest import model_of

    from staticlm.runtime.generate.drive import generate_many
    from staticlm.runtime.generate.loop import GenerationLoop
    from staticlm.runtime.speculative.batch_speculative import BatchSpeculator
    from staticlm.runtime.speculative.drafters import PromptLookupDrafter

    loop = GenerationLoop(model_of(_engine(family)).loop_parts(), rows="segments" if segments else "copies", eager=True)
    assert loop.rows.kind == ("segments" if segments else "copies")
    if speculate:
        loop.rows.speculator = BatchSpeculator([PromptLookupDrafter()] * loop.num_rows)
    return loop.rows, generate_many(loop, ids, params, num_responses=num_responses)


def _single_tokens(family: Path, ids: list[int], params) -> list[int]:
    from conftest import model_of

    return model_of(_engine(family)).generate(ids, params).token_ids


@pytest.mark.parametrize("num_responses", [4, 2])
@pytest.mark.parametrize("name", ["gqa", "windows"])
def test_greedy_responses_equal_single_runs(families, num_responses, name):
    # n = 2 runs on the batch-4 export, its two spare rows inactive. The gqa family's lane pairs its rows: its
    # greedy choices run there as one sequence (Rows.greedy_exact); the windows family's take the segment's rows.
    from staticlm.runtime.engine.segment_engine import SegmentEngine
    from staticlm.runtime.generate.text_stream import GenerationParams

    family = families[name]
    ids = list(np.random.default_rng(8).integers(0, 256, 9))
    params = GenerationParams(max_new_tokens=40, ignore_eos=True, sampling=_varied_greedy())
    gen, responses = _batch_generate(family, ids, params, segments=True, num_responses=num_responses)
    assert isinstance(gen.engine, SegmentEngine) and gen.engine.batch == 4
    assert (gen.engine.counters.num_decode_steps > 0) == gen.greedy_exact == (name == "windows")
    want = _single_tokens(family, ids, params)
    assert len(responses) == num_responses and len(set(want)) > 10
    assert [r.token_ids for r in responses] == [want] * num_responses


def test_seeded_sampled_responses_equal_the_copy_based_path(families):
    from staticlm.runtime.generate.sampling import SamplingParams
    from staticlm.runtime.generate.text_stream import GenerationParams

    family = families["windows"]
    ids = list(np.random.default_rng(9).integers(0, 256, 10))
    params = GenerationParams(max_new_tokens=40, ignore_eos=True,
                              sampling=SamplingParams(temperature=1.0, top_k=50, seed=11))
    _, segmented = _batch_generate(family, ids, params, segments=True)
    copied_gen, copied = _batch_generate(family, ids, params, segments=False)
    assert copied_gen.engine.kv.stats.copied_rows >= 4 * len(ids)  # the reference really copied the prompt
    assert [r.token_ids for r in segmented] == [r.token_ids for r in copied]
    assert len({tuple(r.token_ids) for r in segmented}) > 1  # the sampled answers differ: the test means something


def test_bass_runs_on_segmented_verify_graphs(families):
    # The windows family: its lane runs rows alone (no pairs_rows), so greedy choices take the segment's rows
    # (Rows.greedy_exact); a GroupQueryAttention family's greedy requests run on the lane instead.
    from staticlm.runtime.generate.text_stream import GenerationParams
    from staticlm.runtime.model import open_tokenizer

    family = families["windows"]
    ids = open_tokenizer(family).encode("abcabcabcabc abcabc", add_special_tokens=False)
    params = GenerationParams(max_new_tokens=30, ignore_eos=True)  # plain greedy repeats: lookup drafts find matches
    gen, responses = _batch_generate(family, ids, params, segments=True, speculate=True)
    assert gen.greedy_exact and gen.speculator.stats.num_drafted > 0 and gen.engine.counters.num_verify_steps > 0
    assert [r.token_ids for r in responses] == [_single_tokens(family, ids, params)] * 4


def test_bench_rows_report_both_paths(families):
    # `staticlm bench --only segments`, quick, on the tiny family: the 100-token prompt runs (1,000 does not fit).
    from staticlm.apps.bench.base import BenchContext, BenchOptions
    from staticlm.apps.bench.segments import bench_segments

    family = families["gqa"]
    ctx = BenchContext(options=BenchOptions(model_dir=family, quick=True), model_dir=family, contexts=(256,),
                       prompt_len=100, text_ids=list(np.random.default_rng(3).integers(0, 256, 1200)),
                       max_context=256, decode_steps=4, log=lambda _line: None)
    rows = {r.key: r.ours for r in bench_segments(ctx)}
    assert set(rows) == {f"segments.p100.{k}" for k in ("together", "step_ratio_segment", "step_ratio_copy",
                                                          "kv_segment")}
    assert all(np.isfinite(v) and v > 0 for v in rows.values())
    kv = ctx.extra["segments"][100]["kv_bytes"]
    assert (kv["formula_3_rows"], kv["copy_rows"]) == (100 + 4 * 16, 4 * (100 + 7))  # 8 tokens, 7 fed back
    assert kv["segment"] < kv["copy_valid"] < kv["copy_reserved"]
    # both counters in rows of the same cache_token: the segmented one is formula (3), the copies 4 x (prompt + 7)
    assert kv["segment"] * kv["copy_rows"] == kv["formula_3_rows"] * kv["copy_valid"]
    assert "segments@1000" in ctx.extra["skipped_rows"]


# -- requests that share a cached prefix read its segment in place -----------------------------------------------
def _run_requests(loop, prompts: list[list[int]], params, *, submit_after: list[int]) -> tuple[list, list]:
    """Submit prompt i once the loop has stepped submit_after[i] times; step until every answer ends. Returns the
    answers' tokens and, per step and row that decodes in the rows: (the segment's rows, the row's own rows, its
    prompt's length, the tokens of it the KV holds)."""
    from staticlm.runtime.generate.sequence_request import Finished, SequenceRequest

    events: list[list] = [[] for _ in prompts]
    seen, steps = [], 0
    while steps == 0 or loop.status()["rows_in_use"] or loop.status()["admitting"] or loop.scheduler.num_waiting:
        for i, after in enumerate(submit_after):
            if after == steps:
                loop.submit(SequenceRequest(prompt_ids=prompts[i], params=params, on_event=events[i].append))
        loop.step()
        steps += 1
        rows = [(r, loop.scheduler.occupant(r)) for r in loop.scheduler.busy_rows()]
        seen.append([(loop.rows.engine.segments.num_prompt_rows, int(loop.rows.engine.kv.lengths[r]),
                      len(seq.request.prompt_ids), len(seq.request.prompt_ids) + seq.num_fed)
                     for r, seq in rows if not seq.solo])
    return [list(next(e for e in ev if isinstance(e, Finished)).token_ids) for ev in events], seen


@pytest.mark.parametrize("submit_after", [[0, 0, 0], [0, 3, 5]], ids=["waiting-together", "joining-a-lone-one"])
def test_requests_extending_a_cached_prefix_read_its_segment_in_place(families, submit_after):
    # Three prompts: two share a 24-token prefix (a system prompt), the third shares nothing. Submitted together,
    # the first two read the shared prefix's segment in place at once; submitted later, the second joins the first
    # while it decodes alone on the lane. The third waits until the rows are free. Every answer equals its single
    # run, and no row holds the shared prefix: only what its request adds after it. Sampled and seeded: greedy
    # requests run on the lane of this family (Rows.greedy_exact); a seeded request draws as its single run does.
    from conftest import model_of

    from staticlm.runtime.generate.admission import MIN_SHARED_PREFIX
    from staticlm.runtime.generate.loop import GenerationLoop
    from staticlm.runtime.generate.sampling import SamplingParams
    from staticlm.runtime.generate.text_stream import GenerationParams

    family = families["gqa"]
    rng = np.random.default_rng(12)
    shared = list(rng.integers(0, 256, 24))
    prompts = [shared + [1, *rng.integers(0, 256, 6)], shared + [2, *rng.integers(0, 256, 9)],
               list(rng.integers(0, 256, 12))]
    assert len(shared) >= MIN_SHARED_PREFIX
    params = GenerationParams(max_new_tokens=24, ignore_eos=True,
                              sampling=SamplingParams(temperature=1.0, seed=13, repetition_penalty=10.0))
    want = [_single_tokens(family, ids, params) for ids in prompts]
    assert len(set(map(tuple, want))) == 3 and all(len(set(w)) > 10 for w in want)  # varied answers
    loop = GenerationLoop(model_of(_engine(family)).loop_parts(), rows="segments", eager=True)
    got, seen = _run_requests(loop, prompts, params, submit_after=submit_after)
    assert got == want
    together = [step for step in seen if len(step) == 2]  # the first two decoded side by side in the rows
    assert len(together) >= 10, seen
    for step in together:
        for num_segment, num_own, num_prompt, num_in_kv in step:
            # the segment is the shared prefix; a row holds what its request added after it, nothing more
            assert num_segment == len(shared) and num_own == num_in_kv - len(shared) < num_prompt, step
