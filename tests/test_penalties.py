"""presence/frequency penalties and logit_bias (OpenAI's semantics) as a pure function of logits, against a
naive per-token reference, and through sample()."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staticlm.errors import InvalidOption
from staticlm.runtime.generate.sampling import SamplingParams, adjusted_logits, sample

VOCAB = 12


def naive(logits, generated, presence, frequency, bias):
    out = [float(x) for x in logits]
    for j in range(len(out)):
        c = sum(1 for t in generated if t == j)
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    for token, value in bias:
        if 0 <= token < len(out):
            out[token] += value
    return out


@settings(max_examples=200, deadline=None)
@given(logits=st.lists(st.floats(-50, 50), min_size=VOCAB, max_size=VOCAB),
       generated=st.lists(st.integers(-3, VOCAB + 3), max_size=40),
       presence=st.floats(-2, 2), frequency=st.floats(-2, 2),
       bias=st.lists(st.tuples(st.integers(-2, VOCAB + 2), st.floats(-100, 100)), max_size=5, unique_by=lambda b: b[0]))
def test_adjusted_logits_match_the_per_token_definition(logits, generated, presence, frequency, bias):
    x = np.array(logits, np.float32)
    got = adjusted_logits(x, generated=generated, presence=presence, frequency=frequency, bias=bias)
    np.testing.assert_allclose(got, naive(logits, generated, presence, frequency, bias), rtol=1e-6, atol=1e-4)
    assert np.array_equal(x, np.array(logits, np.float32))  # the caller's logits are untouched


@settings(max_examples=100, deadline=None)
@given(logits=st.lists(st.floats(-5, 5), min_size=VOCAB, max_size=VOCAB),
       prompt=st.lists(st.integers(0, VOCAB - 1), max_size=10),
       generated=st.lists(st.integers(0, VOCAB - 1), max_size=10), frequency=st.floats(0.1, 2))
def test_greedy_sampling_applies_penalties_to_generated_tokens_only(logits, prompt, generated, frequency):
    params = SamplingParams(temperature=0.0, frequency_penalty=frequency, presence_penalty=0.5,
                            num_prompt_tokens=len(prompt))
    x = np.array(logits, np.float32)
    token = sample(x, params, rng=np.random.default_rng(0), history=prompt + generated)
    want = naive(x.tolist(), generated, 0.5, frequency, ())  # of the float32 logits the sampler saw
    assert want[token] == max(want)


def test_a_strong_bias_decides_a_seeded_sample_and_a_ban_excludes_a_token():
    logits = np.zeros(VOCAB, np.float32)
    rng = np.random.default_rng(1)
    forced = SamplingParams(temperature=1.0, seed=1, logit_bias=((7, 100.0),))
    assert {sample(logits, forced, rng=rng) for _ in range(50)} == {7}
    banned = SamplingParams(temperature=1.0, logit_bias=tuple((t, -100.0) for t in range(VOCAB - 1)))
    assert {sample(logits, banned, rng=rng) for _ in range(50)} == {VOCAB - 1}


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"logit_bias": ((1, 101.0),)}])
def test_out_of_range_penalties_are_refused(bad):
    with pytest.raises(InvalidOption):
        SamplingParams(**bad)
