"""Greedy is a function of the tokens: the same prompt gives the same answer whatever path its rows took.

The paths: a cold prefill, a prefix from the lane's cache, a prefix from a batch row's cache (the prompt cache),
other prompt-chunk lengths, a batch shared with other requests, n > 1 answers, speculation, and rows that read a
shared prompt segment. The reference for every path is the cold, single-sequence answer. Two SmolLM2 families:
- rows-alone, the default: staticlm's kernels compute every row alone (attention and linears, Manifest.rows_alone),
  so nothing pairs, and greedy rows share a prompt segment with sampled ones;
- paired: ORT's GroupQueryAttention, which rounds a step of one real row differently from a step of several, so the
  engine never runs a row alone (Engine.pairs_rows); a test shows the paths really disagree when a row may.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from conftest import THREADS, model_of

from staticlm.runtime import kernels
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.generate.sampling import SamplingParams
from staticlm.runtime.generate.sequence_request import Admitted, Finished, SequenceRequest
from staticlm.runtime.generate.text_stream import GenerationParams
from staticlm.runtime.session.device import Device, DeviceOptions
from staticlm.runtime.speculative.drafters import PromptLookupDrafter
from staticlm.runtime.speculative.speculative import Speculator

pytestmark = pytest.mark.slow
FAMILIES = ["rows-alone", "paired"]

TEXT = (Path(__file__).parents[1] / "apps" / "data" / "eval_en.txt").read_text()
PARAMS = GenerationParams(max_new_tokens=32, ignore_eos=True)
NUM_PROMPTS = 6


@pytest.fixture(scope="module")
def smollm2_paired_family(smollm2_loaded, tmp_path_factory) -> Path:
    """The default family with ORT's GroupQueryAttention instead of staticlm's (its linears as the default's)."""
    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.options import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.runtime import kernels

    out = tmp_path_factory.mktemp("smollm2_paired") / "family"
    export_cpu_family(smollm2_loaded, out, options=ExportOptions(contexts=(512,), prefill_len=64, verify_lens=(4, 8),
                                                                 batch_sizes=(4,)),
                      cpu=CpuOptions(gguf_kernels=kernels.available(), staticlm_attention=False))
    return out


@pytest.fixture(params=FAMILIES)
def family(request, smollm2_cpu_family, smollm2_paired_family) -> Path:
    if request.param == "paired":
        return smollm2_paired_family
    if not _model(smollm2_cpu_family).engine.manifest.rows_alone:
        pytest.skip(f"the default family computes rows alone with staticlm's kernels: {kernels.why_missing()}")
    return smollm2_cpu_family


def _model(family, **engine):
    cpu = DeviceOptions(device=Device.CPU, num_threads=THREADS)
    return model_of(Engine(family, options=EngineOptions(device=cpu, **engine)))


def _prompts(model) -> list[list[int]]:
    return [model.tokenizer.encode(TEXT[i * 500:i * 500 + 350]) for i in range(NUM_PROMPTS)]


def _cold(model, ids) -> list[int]:
    model.generator.reset()
    return model.generate(ids, PARAMS).token_ids


def _paths(model, ids) -> dict[str, list[int]]:
    """The answer to ids along paths that share nothing but the tokens."""
    out = {"cold": _cold(model, ids), "all but the last token cached": model.generate(ids, PARAMS).token_ids}
    model.generator.reset()
    model.generator.append_tokens(ids[:len(ids) // 2])
    out["half cached"] = model.generate(ids, PARAMS).token_ids
    return out


def test_the_families_pair_rows_where_their_ops_need_it(family, smollm2_paired_family):
    engine = _model(family).engine
    paired = family == smollm2_paired_family
    assert engine.pairs_rows == paired  # else the tests below would prove nothing about pairing
    assert engine.manifest.rows_alone == engine.manifest.exact_attention == (not paired)


def test_greedy_does_not_depend_on_the_cache_or_the_chunk_length(family):
    model, short_chunks = _model(family), _model(family, prefill_rows=8)
    for ids in _prompts(model):
        paths = _paths(model, ids)
        paths["8-row chunks"] = _cold(short_chunks, ids)
        assert all(answer == paths["cold"] for answer in paths.values()), {k: v[:8] for k, v in paths.items()}


def test_greedy_does_not_depend_on_the_batch_or_speculation(family):
    model = _model(family)
    speculating = model_of(model.engine.__class__(model.engine.model_dir, options=model.engine.options),
                           speculator=Speculator(PromptLookupDrafter()))
    prompts = _prompts(model)
    alone = [_cold(model, ids) for ids in prompts]
    for ids, want in zip(prompts, alone, strict=True):
        assert _cold(speculating, ids) == want
        assert [r.token_ids for r in model.generate_many(ids, PARAMS, num_responses=3)] == [want] * 3
    assert speculating.generator.speculator.stats.num_steps > 0  # the verify graph really ran
    # every prompt at once, joining the rows one step apart: each shares its batch with the others
    loop, finished = model.loop, {}
    for i, ids in enumerate(prompts):
        loop.submit(SequenceRequest(prompt_ids=ids, params=PARAMS, on_event=lambda e, i=i: finished.__setitem__(
            i, list(e.token_ids)) if isinstance(e, Finished) else None))
        loop.step()
    while loop.step():
        pass
    assert [finished[i] for i in range(len(prompts))] == alone
    assert loop.rows.engine.counters.num_decode_steps > 0  # they decoded together on the batch rows


def test_a_row_run_alone_changes_some_answers_where_ort_attends(smollm2_paired_family):
    # Why that engine pairs rows: with a lone decode row the same paths disagree somewhere on these prompts.
    model = _model(smollm2_paired_family, paired_rows=False)
    assert not model.engine.pairs_rows
    disagreements = 0
    for ids in _prompts(model):
        paths = _paths(model, ids)
        disagreements += sum(answer != paths["cold"] for answer in paths.values())
    assert disagreements > 0


def test_a_batch_step_pairs_its_rows_only_for_a_greedy_row(smollm2_paired_family):
    # A paired step puts twice the rows through every linear layer: the rows pay for it only where a greedy answer
    # needs the bits. Logprobs keep the speculator out, so every step is a decode step.
    model = _model(smollm2_paired_family)
    ids = _prompts(model)[0]
    counters = model.loop.rows.engine.counters
    for temperature, want_paired in ((0.7, False), (0.0, True)):
        params = GenerationParams(max_new_tokens=8, ignore_eos=True,
                                  sampling=SamplingParams(temperature=temperature, seed=1))
        steps, paired = counters.num_decode_steps, counters.num_paired_steps
        model.generate_many(ids, params, num_responses=3, num_logprobs=0)
        assert counters.num_decode_steps - steps >= 7  # the choices' tokens after the first, one step each
        assert counters.num_paired_steps - paired == (counters.num_decode_steps - steps if want_paired else 0)


# -- the segments kind: rows that read one shared prompt segment (rows.py, --shared-prompt-kv) ----------------------
# The paired family's segmented graphs sum attention over the prompt segment, the response buffer and the new rows
# apart, where the lane's GroupQueryAttention sums one buffer: a greedy row there parts from the single run (its
# last bits, carried by the int8 activations). So its greedy requests run on the lane (Rows.greedy_exact). The
# rows-alone family's SegmentAttention computes a row as the lane's CachedAttention does: greedy rows stay in the
# segment's rows, beside sampled ones.
def _segments_model(family):
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    cpu = DeviceOptions(device=Device.CPU, num_threads=THREADS)
    return Model(Engine(family, options=EngineOptions(device=cpu)), options=RunOptions(shared_prompt_kv=True))


def _answers(loop, prompts: list[list[int]], *, submit_after: list[int]) -> tuple[list[list[int]], list[int]]:
    """Submit prompt i once the loop has stepped submit_after[i] times; each answer's tokens once all ended, and
    how many of each prompt's tokens came from a cache (Admitted)."""
    finished: dict[int, list[int]] = {}
    num_cached: dict[int, int] = {}

    def on_event(i, e):
        if isinstance(e, Finished):
            finished[i] = list(e.token_ids)
        elif isinstance(e, Admitted):
            num_cached[i] = e.num_cached_tokens

    steps = 0
    while steps == 0 or len(finished) < len(prompts):
        for i, after in enumerate(submit_after):
            if after == steps:
                loop.submit(SequenceRequest(prompt_ids=prompts[i], params=PARAMS, on_event=partial(on_event, i)))
        loop.step()
        steps += 1
    return [finished[i] for i in range(len(prompts))], [num_cached[i] for i in range(len(prompts))]


def test_the_family_reads_a_shared_prompt_segment(family, smollm2_paired_family):
    from staticlm.runtime.engine.segment_engine import SegmentEngine

    rows = _segments_model(family).loop.rows
    assert rows.kind == "segments" and isinstance(rows.engine, SegmentEngine)  # else the tests below prove nothing
    assert rows.greedy_exact == (family != smollm2_paired_family)


def test_greedy_choices_through_a_prompt_segment_equal_the_single_run(family, smollm2_paired_family):
    single, segments = _model(family), _segments_model(family)
    got, want = [], []
    for ids in _prompts(single):
        want.append([_cold(single, ids)] * 3)
        got.append([r.token_ids for r in segments.generate_many(ids, PARAMS, num_responses=3)])
    rows = segments.loop.rows
    if family == smollm2_paired_family:
        # one sequence decoded on the lane for the three choices (three would take more steps), none in the rows
        lane = segments.engine.counters
        assert NUM_PROMPTS <= lane.num_decode_steps + lane.num_verify_steps <= NUM_PROMPTS * (PARAMS.max_new_tokens - 1)
        assert not rows.opened or rows.engine.counters.num_decode_steps == 0
    else:  # the choices decoded in the rows, reading the prompt where the lane holds it
        assert rows.engine.counters.num_decode_steps >= NUM_PROMPTS * (PARAMS.max_new_tokens - 1)
    assert got == want


def test_sampled_choices_still_read_one_prompt_segment(smollm2_paired_family):
    # The segments' memory saving stays where no greedy promise is at stake: sampled choices decode in the rows,
    # which read the prompt's rows in place.
    segments = _segments_model(smollm2_paired_family)
    ids = _prompts(segments)[0]
    params = GenerationParams(max_new_tokens=8, ignore_eos=True, sampling=SamplingParams(temperature=0.7, seed=1))
    answers = segments.generate_many(ids, params, num_responses=3)
    engine = segments.loop.rows.engine
    assert len(answers) == 3 and engine.counters.num_decode_steps >= 7
    assert engine.segments.num_prompt_rows == len(ids)


@pytest.mark.parametrize("submit_after", [[0, 0, 0], [0, 3, 5]], ids=["waiting-together", "joining-a-lone-one"])
def test_greedy_requests_sharing_a_cached_prefix_equal_their_single_runs(family, smollm2_paired_family, submit_after):
    # Three questions after one shared text (a system prompt), submitted together or while the first decodes. The
    # paired family runs each on the lane in turn, the shared text taken from the lane's cache; the rows-alone one
    # decodes them together in rows that read the shared text once. Each answers as its single run does.
    from staticlm.runtime.generate.admission import MIN_SHARED_PREFIX

    single, segments = _model(family), _segments_model(family)
    encode = single.tokenizer.encode
    shared = encode(TEXT[4000:4200])
    prompts = [shared + encode(TEXT[5000 + 300 * k:5120 + 300 * k]) for k in range(3)]
    assert len(shared) >= MIN_SHARED_PREFIX
    want = [_cold(single, ids) for ids in prompts]
    got, num_cached = _answers(segments.loop, prompts, submit_after=submit_after)
    assert num_cached[0] == 0 and min(num_cached[1:]) >= len(shared)  # the later ones did not prefill it again
    assert got == want
    rows = segments.loop.rows
    if family != smollm2_paired_family:  # together: fewer row steps than the three answers' tokens
        assert 0 < rows.engine.counters.num_decode_steps < 3 * (PARAMS.max_new_tokens - 1)


def test_greedy_and_sampled_requests_decode_together_on_one_prompt_segment(family, smollm2_paired_family):
    # A greedy request and a sampled one after a shared text, submitted together: on the rows-alone family both
    # decode in the same row steps and the greedy answer is its single run's; on the paired one the greedy request
    # holds the lane and the sampled one waits for it.
    from staticlm.runtime.generate.sampling import SamplingParams

    single, segments = _model(family), _segments_model(family)
    encode = single.tokenizer.encode
    shared = encode(TEXT[4000:4200])
    greedy_ids, sampled_ids = shared + encode(TEXT[5000:5120]), shared + encode(TEXT[5300:5420])
    want = _cold(single, greedy_ids)
    sampled = GenerationParams(max_new_tokens=PARAMS.max_new_tokens, ignore_eos=True,
                               sampling=SamplingParams(temperature=0.8, seed=3))
    finished: dict[str, list[int]] = {}
    at: dict[tuple[str, str], int] = {}  # (request, event) -> the loop step it came in
    steps = 0

    def on_event(name, e):
        if isinstance(e, Admitted | Finished):
            at[name, type(e).__name__] = steps
        if isinstance(e, Finished):
            finished[name] = list(e.token_ids)
    for name, ids, params in (("greedy", greedy_ids, PARAMS), ("sampled", sampled_ids, sampled)):
        segments.loop.submit(SequenceRequest(prompt_ids=ids, params=params, on_event=partial(on_event, name)))
    while segments.loop.step():
        steps += 1
    assert finished["greedy"] == want and len(finished["sampled"]) == PARAMS.max_new_tokens
    if family == smollm2_paired_family:  # one after the other
        assert at["sampled", "Admitted"] >= at["greedy", "Finished"]
    else:  # side by side, in the segment's rows
        assert at["sampled", "Admitted"] < at["greedy", "Finished"]
        assert segments.loop.rows.engine.counters.num_decode_steps >= PARAMS.max_new_tokens - 1
