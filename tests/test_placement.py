"""Placement (runtime/generate/placement.py): where a request runs and whether its rows pair.

The rules, property by property over every family's facts; then the promise they keep, on generated mixes of
requests: for any mix of greedy and sampled requests, n choices, a shared prefix, the family's flags
(--shared-prompt-kv) and speculation, every greedy choice's tokens are its prompt's single cold run on the lane
(tests/test_greedy_paths.py writes such cases by hand on SmolLM2). Two tiny families: one whose ops compute every
row alone (staticlm's attention and GGUF kernels) and one whose rows pair (ORT's GroupQueryAttention).
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from conftest import THREADS
from gguf import GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gguf_grids import quantizer, tiny_llama  # noqa: F401 -- tiny_llama is a fixture

from staticlm.runtime.generate import placement as pl
from staticlm.runtime.generate.placement import COPIES, SEGMENTS, FamilyFacts, Where

facts = st.builds(FamilyFacts, num_copy_rows=st.sampled_from([1, 2, 4]), num_segment_rows=st.sampled_from([1, 2, 4]),
                  can_segment=st.booleans(), exact_attention=st.booleans(), pairs_rows=st.booleans(),
                  shared_prompt_kv=st.booleans())


@given(facts, st.sampled_from([None, COPIES, SEGMENTS]))
def test_the_rows_are_a_kind_the_family_has(f, forced):
    kind = pl.rows_kind(f, forced=forced)
    if kind == SEGMENTS:
        assert f.can_segment and f.num_segment_rows > 1 and forced in (None, SEGMENTS)
        assert forced == SEGMENTS or f.shared_prompt_kv or f.num_copy_rows == 1  # copies are the default
    elif kind == COPIES:
        assert f.num_copy_rows > 1
    else:
        assert f.num_copy_rows == 1 and not (f.can_segment and f.num_segment_rows > 1 and forced != COPIES)
    assert (pl.num_rows(f, kind) > 1) == (kind is not None)


@given(facts, st.sampled_from([None, COPIES, SEGMENTS]), st.booleans())
def test_a_greedy_request_goes_only_where_it_gets_the_lanes_bits(f, forced, greedy):
    kind = pl.rows_kind(f, forced=forced)
    where = pl.place(f, kind, greedy=greedy)
    if where is Where.ROWS and greedy and kind is not None:
        assert pl.greedy_exact(f, kind)
    if not greedy or kind != SEGMENTS:
        assert where is Where.ROWS  # sampled rows and copies (the lane's graphs at any batch) need no lane
    if kind == SEGMENTS and greedy:  # the segmented graphs differ from the lane only where rows pair
        assert (where is Where.LANE) == (f.pairs_rows and not f.exact_attention)


@given(st.lists(st.booleans(), min_size=1, max_size=4))
def test_a_batch_step_pairs_only_for_a_greedy_row(greedy_rows):
    assert pl.pairs_batch_step(greedy_rows) == any(greedy_rows)


# -- the promise, on generated requests ----------------------------------------------------------------------------
KERNEL_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q5_0, "attn_v": T.Q6_K, "attn_output": T.Q8_0, "ffn_gate": T.Q4_1,
                "ffn_up": T.Q5_K, "ffn_down": T.Q5_1, "token_embd": T.Q8_0, "output": T.Q6_K}  # all GgufMatMul's
NEW_TOKENS, SHARED = 5, 18  # the shared prefix is longer than admission's MIN_SHARED_PREFIX


@pytest.fixture(scope="module", params=["rows-alone", "paired"])
def family(request, tiny_llama, tmp_path_factory):  # noqa: F811
    from tiny_archs import write_gguf

    from staticlm.export.cpu.family import export_cpu_family
    from staticlm.export.cpu.graph import CpuOptions
    from staticlm.export.family import ExportOptions
    from staticlm.export.sources import load_model
    from staticlm.runtime import kernels

    alone = request.param == "rows-alone"
    if not kernels.available():
        pytest.skip(f"both families use staticlm's kernels (GgufMatMul): {kernels.why_missing()}")
    path = write_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny.gguf", arch="llama",
                      quantize=quantizer(KERNEL_TYPES, np.random.default_rng(5)))
    out = tmp_path_factory.mktemp(request.param) / "family"
    manifest = export_cpu_family(load_model(path), out, options=ExportOptions(
        contexts=(64,), prefill_len=8, verify_lens=(4,), batch_sizes=(3,)),
        cpu=CpuOptions(gguf_kernels=True, staticlm_attention=alone))
    assert manifest.rows_alone == manifest.exact_attention == alone  # else the two cases are one
    return out


@pytest.fixture(scope="module")
def models(family):
    """(shared_prompt_kv, speculate) -> a model of the family, opened once (their prompt caches carry over from one
    example to the next: one more path a greedy answer must not depend on)."""
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    opened: dict = {}

    def get(shared_prompt_kv: bool = False, speculate: str = "none"):
        key = (shared_prompt_kv, speculate)
        if key not in opened:
            options = RunOptions(model_dir=family, num_threads=THREADS, shared_prompt_kv=shared_prompt_kv,
                                 speculate=speculate, device="cpu")
            opened[key] = Model.open(family, options, warm_up=False)
        return opened[key]
    return get


requests = st.lists(st.fixed_dictionaries({
    "greedy": st.booleans(), "num_choices": st.integers(1, 3), "shares_prefix": st.booleans(),
    "own": st.lists(st.integers(0, 255), min_size=2, max_size=12), "submit_at": st.integers(0, 3),
    "seed": st.integers(0, 2**16), "logprobs": st.booleans()}), min_size=1, max_size=3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(mix=requests, shared_prompt_kv=st.booleans(), speculate=st.sampled_from(["none", "lookup"]),
       prefix=st.lists(st.integers(0, 255), min_size=SHARED, max_size=SHARED))
def test_greedy_answers_equal_single_runs_for_any_mix(models, mix, shared_prompt_kv, speculate, prefix):
    from staticlm.runtime.generate.sampling import SamplingParams
    from staticlm.runtime.generate.sequence_request import Delta, Finished, SequenceRequest
    from staticlm.runtime.generate.text_stream import GenerationParams

    prompts = [(prefix if r["shares_prefix"] else []) + r["own"] for r in mix]
    single = models()
    want = []
    for r, ids in zip(mix, prompts, strict=True):
        single.generator.reset()
        result = single.generate(ids, GenerationParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), num_logprobs=0)
        want.append((result.token_ids, [lp.logprob for lp in result.logprobs] if r["logprobs"] else None))
    loop = models(shared_prompt_kv, speculate).loop
    got: dict[tuple[int, int], tuple] = {}
    logprobs: dict[tuple[int, int], list[float]] = {}

    def on_event(i, event):
        if isinstance(event, Delta):
            logprobs.setdefault((i, event.choice), []).extend(lp.logprob for lp in event.logprobs)
        if isinstance(event, Finished):
            got[i, event.choice] = (list(event.token_ids), logprobs.get((i, event.choice)) if mix[i]["logprobs"]
                                    else None)

    for step in range(64):  # bounded: a few requests of NEW_TOKENS tokens end long before
        for i, r in enumerate(mix):
            if r["submit_at"] == step:
                sampling = SamplingParams() if r["greedy"] else SamplingParams(temperature=0.9, seed=r["seed"])
                # logprobs: the greedy rows' logits to the last bit (the promise is the same bits, not only the same
                # argmax: a random tiny model has no near-tie for a last bit to flip); none keeps speculation on
                loop.submit(SequenceRequest(prompt_ids=prompts[i], num_choices=r["num_choices"],
                                            num_logprobs=0 if r["logprobs"] else None,
                                            params=GenerationParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                                    sampling=sampling),
                                            on_event=partial(on_event, i)))
        if not loop.step() and step > max(r["submit_at"] for r in mix):
            break
    assert len(got) == sum(r["num_choices"] for r in mix)
    for i, r in enumerate(mix):
        if r["greedy"]:
            assert [got[i, c] for c in range(r["num_choices"])] == [want[i]] * r["num_choices"], (i, mix)
