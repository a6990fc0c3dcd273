"""Text plumbing around the model: sampling, tokenizer, streaming detokenizer, stop strings, chat templates.

References are independent of the code under test: numpy/math softmax, str.find, brute-force scans,
the raw `tokenizers` decode, and transformers' apply_chat_template.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import CHATML, THREADS, TINY_SPECIALS, tiny_tokenizer_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staticlm.runtime.generate.sampling import SamplingParams, distribution, greedy, sample
from staticlm.runtime.text.chat_template import DEFAULT_CHATML, ChatTemplateError, Message, render_chat
from staticlm.runtime.text.stopping import StopStringMatcher

BOS, EOS = 259, 258  # "<s>" and "<|im_end|>" in the tiny tokenizer


# ---------------------------------------------------------------------------------------------- helpers
def _raw_byte_level():
    from tokenizers import Tokenizer as HF

    return HF.from_str(tiny_tokenizer_json())


def _raw_byte_level_with_merges():
    """Byte-level BPE with merges, so one token can hold a whole multi-byte character or part of one."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = _merges(vocab, ["Ġthe", "Ġa", "he", "ðŁ", "ðŁĺ", "ä¸", "Ã©", "ll"])  # " the", " a", emoji/CJK/é leads
    tok = HF(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TINY_SPECIALS)
    return tok


def _merges(vocab: dict[str, int], words: list[str]) -> list[tuple[str, str]]:
    """BPE merges that build each word left to right, each new piece added to vocab."""
    merges = []
    for word in words:
        left = word[0]
        for ch in word[1:]:
            if left + ch not in vocab:
                merges.append((left, ch))
                vocab[left + ch] = len(vocab)
            left += ch
    return merges


def _raw_sentencepiece_style():
    """Llama-style: '▁' for spaces, prepended to the text, byte fallback, leading space stripped on decode."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, normalizers

    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + list("abcdefghijklmnopqrstuvwxyz.,!?")
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = _merges(vocab, ["▁the", "▁a", "▁hello", "he"])
    tok = HF(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def _wrap(raw, **kwargs):
    from staticlm.runtime.text.tokenizer import Tokenizer

    return Tokenizer(raw, **{"bos_token_id": None, "eos_token_ids": (), **kwargs})


def _stream(tokenizer, ids) -> list[str]:
    from staticlm.runtime.text.detokenizer import StreamDecoder

    decoder = StreamDecoder(tokenizer)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


RAW_TOKENIZERS = {"byte_level": _raw_byte_level, "byte_level_merges": _raw_byte_level_with_merges,
                  "sentencepiece": _raw_sentencepiece_style}
# Arbitrary unicode, plus text built from pieces that exercise merges, spaces and multi-byte characters.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.lists(
    st.sampled_from(list("ab é中文😀👍🏽\n") + ["the", " the", "hello"]), max_size=20).map("".join)


# ---------------------------------------------------------------------------------------------- detokenizer
@pytest.mark.parametrize("kind", sorted(RAW_TOKENIZERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, special_at=st.lists(st.integers(0, 60), max_size=3))
def test_stream_decoder_equals_full_decode(kind, text, special_at):
    raw = RAW_TOKENIZERS[kind]()
    ids = raw.encode(text, add_special_tokens=False).ids
    special = raw.token_to_id("<s>")
    for position in sorted(special_at, reverse=True):  # specials anywhere, even inside a character's bytes
        ids.insert(min(position, len(ids)), special)
    chunks = _stream(_wrap(raw), ids)
    assert "".join(chunks) == raw.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in c for c in chunks) or "\ufffd" in text


def test_stream_decoder_holds_back_split_characters():
    raw = _raw_byte_level()
    ids = raw.encode("é😀x", add_special_tokens=False).ids
    assert len(ids) == 2 + 4 + 1  # one token per byte: every non-ASCII character is split
    assert _stream(_wrap(raw), ids) == ["", "é", "", "", "", "😀", "x", ""]


def test_stream_decoder_keeps_sentencepiece_spaces():
    raw = _raw_sentencepiece_style()
    ids = raw.encode("the cat sat", add_special_tokens=False).ids
    assert "".join(_stream(_wrap(raw), ids)) == "the cat sat"
    later = raw.encode("hello world", add_special_tokens=False).ids
    # A window that starts mid-text must keep the space that begins its first piece.
    assert "".join(_stream(_wrap(raw), ids + later)) == "the cat sat hello world"


def test_stream_decoder_decodes_a_bounded_window():
    raw = _raw_byte_level()
    tokenizer = _wrap(raw)
    sizes: list[int] = []
    original = tokenizer.decode

    def spy(ids, **kwargs):
        ids = list(ids)
        sizes.append(len(ids))
        return original(ids, **kwargs)

    tokenizer.decode = spy
    text = "plain ascii, é and 中文 and 😀 " * 100
    ids = raw.encode(text, add_special_tokens=False).ids
    assert "".join(_stream(tokenizer, ids)) == text
    assert max(sizes) <= 8  # never the whole sequence: per-token cost does not grow with length


def test_stream_decoder_flushes_an_unfinished_character():
    for raw in (_raw_byte_level(), _raw_sentencepiece_style()):
        ids = raw.encode("a😀", add_special_tokens=False).ids[:-1]  # the emoji's last byte never comes
        chunks = _stream(_wrap(raw), ids)
        assert chunks[:-1] == ["a"] + [""] * (len(ids) - 1)
        assert chunks[-1] and set(chunks[-1]) == {"\ufffd"}  # the flush shows what there is, as a full decode does
        assert "".join(chunks) == raw.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", sorted(RAW_TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(picks=st.lists(st.integers(0, 2**16), max_size=30))
def test_stream_decoder_takes_any_ids(kind, picks):
    # A model may emit any ids, byte tokens that never form UTF-8 included: the text goes on, nothing raises.
    raw = RAW_TOKENIZERS[kind]()
    ids = [p % raw.get_vocab_size() for p in picks]
    chunks = _stream(_wrap(raw), ids)
    full = raw.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in full:
        assert "".join(chunks) == full


def test_stream_decoder_goes_on_when_shown_text_turns_invalid():
    raw = _raw_sentencepiece_style()
    ids = [raw.token_to_id(t) for t in ("<0x3D>", "<0x9D>", "j")]  # "=", then a byte no character starts with
    assert raw.decode(ids) == "\ufffd\ufffdj"  # byte fallback takes the "=" back into the invalid run ...
    assert _stream(_wrap(raw), ids) == ["=", "", "\ufffdj", ""]  # ... a stream cannot: it already showed it


# ---------------------------------------------------------------------------------------------- text stream
def _text_stream(**kwargs):
    from staticlm.runtime.generate.text_stream import GenerationParams, TextStream

    tokenizer = _wrap(_raw_byte_level(), eos_token_ids=(EOS,))
    return TextStream(tokenizer, GenerationParams(**{"max_new_tokens": 50, **kwargs}))


def _bytes_of(text: str) -> list[int]:
    return _raw_byte_level().encode(text, add_special_tokens=False).ids


def _push_all(stream, ids) -> list[str]:
    out = []
    for i, token in enumerate(ids):
        out.append(stream.push(token, now=float(i)))
        if stream.reason is not None:
            break
    return out


def test_text_stream_ends_at_eos_and_flushes_what_was_held():
    from staticlm.runtime.generate.text_stream import FinishReason

    stream = _text_stream(stop_strings=("é!",))
    ids = _bytes_of("hi é") + [EOS] + _bytes_of("never")
    shown = _push_all(stream, ids)
    # "é" is held (it might begin the stop string "é!") until EOS makes it final; EOS itself is never shown
    assert "".join(shown[:-1]) == "hi " and shown[-1] == "é"
    assert stream.reason is FinishReason.EOS and stream.ids == ids[:len(ids) - 5] and stream.text == "hi é"
    assert (stream.first_s, stream.last_s) == (0.0, float(len(stream.ids) - 1))
    with pytest.raises(RuntimeError):
        stream.push(_bytes_of("x")[0], now=9.0)
    ignoring = _text_stream(ignore_eos=True)
    _push_all(ignoring, ids)
    assert ignoring.reason is None and ignoring.text == "hi énever" and len(ignoring.ids) == len(ids)


def test_text_stream_cuts_at_a_stop_string_and_stops_at_the_length_limit():
    from staticlm.runtime.generate.text_stream import FinishReason

    stopped = _text_stream(stop_strings=("</s>",))
    _push_all(stopped, _bytes_of("one</s>two"))
    assert stopped.reason is FinishReason.STOP_STRING and stopped.text == "one" and len(stopped.ids) == 7
    limited = _text_stream(max_new_tokens=4, stop_strings=("xyz",))
    shown = _push_all(limited, _bytes_of("abcxy-more"))
    assert limited.reason is FinishReason.LENGTH and shown == ["a", "b", "c", "x"]  # the held "x" is final now
    split = _text_stream(max_new_tokens=2)
    assert _push_all(split, _bytes_of("é")[:1] + _bytes_of("z")) == ["", "\ufffdz"]


def test_text_stream_cancel_shows_the_held_back_text():
    from staticlm.runtime.generate.text_stream import FinishReason

    stream = _text_stream(stop_strings=("ab",))
    assert _push_all(stream, _bytes_of("xa")) == ["x", ""]
    assert stream.cancel() == "a" and stream.reason is FinishReason.CANCELLED and stream.text == "xa"
    assert stream.cancel() == ""


def test_tiny_single_and_batched_generation_show_the_same_text(tiny_chat_family):
    from conftest import model_of

    from staticlm.runtime.engine.engine import Engine, EngineOptions
    from staticlm.runtime.generate.text_stream import FinishReason, GenerationParams
    from staticlm.runtime.model import open_tokenizer
    from staticlm.runtime.session.device import Device, DeviceOptions

    cpu = EngineOptions(device=DeviceOptions(device=Device.CPU, num_threads=THREADS))
    tokenizer = open_tokenizer(tiny_chat_family)
    prompt = tokenizer.encode("abcabc abc", add_special_tokens=False)
    single = model_of(Engine(tiny_chat_family, options=cpu))
    batch = model_of(Engine(tiny_chat_family, options=cpu))  # a model of its own: its rows, not single's lane
    full = single.generate(prompt, GenerationParams(max_new_tokens=24, ignore_eos=True))
    stop = full.text[len(full.text) // 2:][:2]  # a stop string the answer reaches half way
    assert len(stop) == 2
    for params, reason in ((GenerationParams(max_new_tokens=24, ignore_eos=True), FinishReason.LENGTH),
                           (GenerationParams(max_new_tokens=24, ignore_eos=True, stop_strings=(stop,)),
                            FinishReason.STOP_STRING)):
        chunks = list(single.stream(prompt, params))
        want = single.last_result
        assert want.finish_reason is reason and "".join(chunks) == want.text
        shown: dict[int, list[str]] = {seq: [] for seq in range(4)}
        responses = batch.generate_many(prompt, params, num_responses=4,
                                        on_text=lambda seq, text, shown=shown: shown[seq].append(text))
        assert batch.loop.rows.kind is not None  # the four answers ran on batch rows, not one by one
        for seq, response in enumerate(responses):
            assert (response.text, response.token_ids, response.finish_reason) == (
                want.text, want.token_ids, want.finish_reason)
            assert "".join(shown[seq]) == want.text


# ---------------------------------------------------------------------------------------------- stop strings
def _run_stops(stops, chunks):
    matcher = StopStringMatcher(stops)
    out, stopped = [], False
    for chunk in chunks:
        text, stopped = matcher.push(chunk)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


def _chunked(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=400, deadline=None)
@given(text=st.text("ab<>/", max_size=30), stop=st.text("ab<>/", min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 30), max_size=10))
def test_stop_string_matches_split_of_the_full_text(text, stop, cuts):
    emitted, stopped = _run_stops([stop], _chunked(text, cuts))
    assert stopped == (text.find(stop) >= 0)
    assert emitted == text.split(stop)[0]


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=25), stops=st.lists(st.text("abc", min_size=1, max_size=3), min_size=1,
                                                        max_size=3), cuts=st.lists(st.integers(0, 25), max_size=8))
def test_several_stop_strings_cut_where_the_first_one_completes(text, stops, cuts):
    expected, expect_stop = text, False
    for end in range(len(text) + 1):  # brute force: the first prefix of the text that ends in a stop string
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            expected, expect_stop = text[:end - max(map(len, done))], True
            break
    assert _run_stops(stops, _chunked(text, cuts)) == (expected, expect_stop)


def test_stop_string_holds_back_only_a_possible_start():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("Hello <") == ("Hello ", False)
    assert matcher.push("b>") == ("<b>", False)
    assert matcher.push(" end</") == (" end", False)
    assert matcher.push("s> tail") == ("", True)
    assert matcher.push("more") == ("", True)
    assert StopStringMatcher([]).push("abc</s>") == ("abc</s>", False)
    held = StopStringMatcher(["###"])
    assert held.push("x##") == ("x", False) and held.flush() == "##"


# ---------------------------------------------------------------------------------------------- sampling
def _softmax(values):
    exps = [math.exp(v - max(values)) for v in values]
    return [e / sum(exps) for e in exps]


def _frequencies(logits, params, draws=20000, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.bincount([sample(logits, params, rng=rng) for _ in range(draws)], minlength=len(logits))
    return counts / draws


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-50, 50), min_size=2, max_size=64, unique=True), st.floats(0.05, 5.0),
       st.integers(0, 2**32 - 1))
def test_greedy_and_top_k_1_are_argmax(values, temperature, seed):
    logits = np.array(values, dtype=np.float64)  # float64 keeps the drawn values distinct
    expected = values.index(max(values))
    rng = np.random.default_rng(seed)
    assert sample(logits, SamplingParams(), rng=rng) == expected
    assert greedy(logits) == expected
    assert sample(logits, SamplingParams(temperature=temperature, top_k=1), rng=rng) == expected
    assert sample(logits, SamplingParams(temperature=temperature, top_p=1e-9), rng=rng) == expected


def test_empirical_frequencies_follow_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0], dtype=np.float32)
    expected = np.array(_softmax([2.0, 1.0, 0.5, 0.0, -1.0]))
    observed = _frequencies(logits, SamplingParams(temperature=1.0))
    chi2 = float(np.sum((observed - expected) ** 2 / expected) * 20000)
    assert chi2 < 18.47, (observed, expected)  # chi-square, 4 degrees of freedom, p = 0.001
    hot = _frequencies(logits, SamplingParams(temperature=2.0))
    assert np.allclose(hot, _softmax([v / 2 for v in [2.0, 1.0, 0.5, 0.0, -1.0]]), atol=0.015)


def test_top_k_top_p_min_p_restrict_the_candidates():
    probs = [0.5, 0.3, 0.1, 0.07, 0.03]
    logits = np.log(np.array(probs))[::-1].copy()  # most likely token last: order must not matter
    top2 = _frequencies(logits, SamplingParams(temperature=1.0, top_k=2), draws=8000)
    assert np.allclose(top2, [0, 0, 0, 0.375, 0.625], atol=0.02)
    nucleus = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.75), draws=8000)
    assert np.allclose(nucleus, [0, 0, 0, 0.375, 0.625], atol=0.02)  # 0.5 + 0.3 is the first to reach 0.75
    floor = _frequencies(logits, SamplingParams(temperature=1.0, min_p=0.19), draws=8000)
    assert np.allclose(floor, [0, 0, 0.1 / 0.9, 0.3 / 0.9, 0.5 / 0.9], atol=0.02)  # keeps p >= 0.095


def _naive_nucleus(logits: np.ndarray, *, temperature: float, top_p: float) -> np.ndarray:
    """Every token sorted (likeliest first, ties by id), the shortest prefix reaching top_p, renormalised."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-z[i], i))
    mass, keep = 0.0, []
    for i in order:
        keep.append(i)
        mass += p[i]
        if mass >= top_p:
            break
    out = np.zeros(len(p))
    out[keep] = p[keep] / p[keep].sum()
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([300, 5000, 49152]), st.floats(0.05, 30.0),
       st.floats(0.3, 2.0), st.floats(0.05, 0.999))
def test_top_p_over_a_large_vocabulary_keeps_the_sorted_nucleus(seed, vocab, spread, temperature, top_p):
    # Large vocabularies take the partial path (only the likeliest tokens are sorted): it must keep exactly the
    # nucleus a full sort gives, from peaked (spread 30) to nearly flat (spread 0.05) logits.
    logits = (np.random.default_rng(seed).standard_normal(vocab) * spread).astype(np.float32)
    got = distribution(logits, SamplingParams(temperature=temperature, top_p=top_p))
    want = _naive_nucleus(logits, temperature=temperature, top_p=top_p)
    assert np.array_equal(got > 0, want > 0)
    assert np.allclose(got, want, rtol=1e-9, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(1.05, 2.0), st.floats(0.3, 0.999))
def test_top_p_after_a_repetition_penalty_keeps_the_sorted_nucleus(seed, penalty, top_p):
    # The penalised scores are float64 and reordered; the nucleus must still be the one a full sort gives.
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(49152) * 4).astype(np.float32)
    history = rng.integers(0, 49152, size=300)
    got = distribution(logits, SamplingParams(temperature=0.8, top_p=top_p, repetition_penalty=penalty),
                       history=history.tolist())
    penalised = logits.astype(np.float64)
    seen = np.unique(history)  # CTRL: positive scores divided, negative multiplied, once per distinct token
    penalised[seen] = np.where(penalised[seen] > 0, penalised[seen] / penalty, penalised[seen] * penalty)
    want = _naive_nucleus(penalised, temperature=0.8, top_p=top_p)
    assert np.array_equal(got > 0, want > 0)
    assert np.allclose(got, want, rtol=1e-9, atol=1e-12)


def test_seeded_sampling_is_reproducible():
    logits = np.random.default_rng(7).normal(size=100).astype(np.float32)
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.95)

    def draw(seed):
        rng = np.random.default_rng(seed)
        return [sample(logits, params, rng=rng) for _ in range(50)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_repetition_penalty_changes_the_argmax():
    logits = np.array([2.0, 1.9, -3.0, -0.5, -0.6], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingParams(), rng=rng, history=[0]) == 0
    assert sample(logits, SamplingParams(repetition_penalty=1.2), rng=rng, history=[0, 0, 0]) == 1  # 2/1.2 < 1.9
    negative = np.array([-0.5, -0.6], dtype=np.float32)
    assert sample(negative, SamplingParams(repetition_penalty=2.0), rng=rng, history=[0]) == 1  # -0.5*2 < -0.6


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sampling_does_not_mutate_logits(dtype):
    logits = np.random.default_rng(1).normal(size=50).astype(dtype)
    before = logits.copy()
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.3)
    sample(logits, params, rng=np.random.default_rng(0), history=list(range(20)))
    sample(logits, SamplingParams(repetition_penalty=1.3), rng=np.random.default_rng(0), history=[1, 2])
    assert np.array_equal(logits, before)


@pytest.mark.parametrize("kwargs, option", [
    ({"temperature": -1}, "--temperature"), ({"top_k": -1}, "--top-k"), ({"top_p": 0.0}, "--top-p"),
    ({"top_p": 1.5}, "--top-p"), ({"min_p": 1.0}, "--min-p"), ({"repetition_penalty": 0.0}, "--repetition-penalty"),
    ({"temperature": float("nan")}, "--temperature")])
def test_invalid_sampling_params_raise(kwargs, option):
    with pytest.raises(ValueError, match=option) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_bos_and_specials(tmp_path):
    from staticlm.runtime.text.tokenizer import Tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(tiny_tokenizer_json())
    tok = Tokenizer.from_file(path, bos_token_id=BOS, eos_token_ids=[EOS], add_bos_token=True)
    raw_ids = _raw_byte_level().encode("hi", add_special_tokens=False).ids
    assert len(raw_ids) == 2 and BOS not in raw_ids
    assert tok.encode("hi") == [BOS, *raw_ids]
    assert tok.encode("hi", add_special_tokens=False) == raw_ids
    assert tok.eos_token_ids == (EOS,) and tok.bos_token_id == BOS and tok.vocab_size == 260
    assert tok.special_ids == frozenset({256, 257, 258, 259})
    assert tok.decode([BOS, *raw_ids, EOS], skip_special_tokens=True) == "hi"
    assert tok.decode([BOS, *raw_ids]) == "<s>hi"
    assert tok.token_to_id("<|im_end|>") == EOS and tok.id_to_token(EOS) == "<|im_end|>"
    assert Tokenizer.from_file(path, bos_token_id=BOS, eos_token_ids=[EOS]).encode("hi") == raw_ids


def test_tokenizer_does_not_double_a_post_processor_bos():
    from tokenizers import processors

    raw = _raw_byte_level()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    ids = _wrap(raw, bos_token_id=BOS, add_bos_token=True).encode("hi")
    assert ids[0] == BOS and ids.count(BOS) == 1


def test_tokenizer_file_errors_are_one_line(tmp_path):
    from staticlm.runtime.text.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.json", bos_token_id=None, eos_token_ids=[])
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": ')
    with pytest.raises(ValueError, match="cannot read tokenizer") as info:
        Tokenizer.from_file(bad, bos_token_id=None, eos_token_ids=[])
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- chat template
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <there> & \"you\" — 中文 😀"},
    {"role": "assistant", "content": "Hello!\n  Indented."},
    {"role": "user", "content": "Again?"},
]
RICH = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'tool' %}"
        "{{ raise_exception('no tools') }}{% endif %}\n  {% generation %}{{ message | tojson }}{% endgeneration %}\n"
        "{% if loop.index == 3 %}{% continue %}{% endif %}[{{ loop.index }}]\n{% endfor %}{{ eos_token }}"
        "{% if add_generation_prompt %}>>{% endif %}")


@pytest.mark.parametrize("template", [CHATML, DEFAULT_CHATML, RICH], ids=["chatml", "default", "rich"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("turns", [1, 2, 4])
def test_render_chat_matches_transformers(template, add_generation_prompt, turns):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_raw_byte_level(), chat_template=template,
                                              bos_token="<s>", eos_token="<|im_end|>")
    messages = CONVERSATION[-turns:]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = render_chat(template, [Message(**m) for m in messages], add_generation_prompt=add_generation_prompt,
                      bos_token="<s>", eos_token="<|im_end|>")
    assert got == expected
    assert render_chat(template, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>",
                       eos_token="<|im_end|>") == expected


def test_render_chat_known_output_and_unset_tokens():
    text = render_chat(DEFAULT_CHATML, [Message("user", "hi")], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat("[{{ bos_token }}]", [], add_generation_prompt=False) == "[]"  # not "None"
    assert json.loads(render_chat("{{ messages[0] | tojson }}", [Message("user", "<é>")],
                                  add_generation_prompt=False)) == {"role": "user", "content": "<é>"}
    assert "<é>" in render_chat("{{ messages[0] | tojson }}", [Message("user", "<é>")], add_generation_prompt=False)


@pytest.mark.parametrize("template, messages", [
    ("{% for message in messages %}{{ message['content'] }", [{"role": "user", "content": "x"}]),
    ("{% if %}", []),
    (RICH, [{"role": "tool", "content": "x"}]),
    ("{{ messages[0].__class__.__mro__ }}", [{"role": "user", "content": "x"}]),
])
def test_template_errors_are_chat_template_errors(template, messages):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, messages, add_generation_prompt=True)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_message_validates_role():
    with pytest.raises(ValueError, match="role"):
        Message(role="robot", content="x")
    assert Message(role="tool", content="x").role == "tool"


def test_message_from_openai_reads_what_an_openai_request_carries():
    m = Message.from_openai({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": [1, \"é\"]}"}},
        {"type": "function", "function": {"name": "g", "arguments": "not json"}},
        {"type": "function", "function": {"name": "h", "arguments": ""}}]})
    assert m.content is None and [c.name for c in m.tool_calls] == ["f", "g", "h"]
    assert m.to_dict() == {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": [1, "é"]}}},
        {"type": "function", "function": {"name": "g", "arguments": "not json"}},
        {"type": "function", "function": {"name": "h", "arguments": {}}}]}
    tool = Message.from_openai({"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"})
    assert tool.to_dict() == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}
    parts = Message.from_openai({"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]})
    assert (parts.role, parts.content) == ("system", "ab")
    assert Message("user", "hi").to_dict() == {"role": "user", "content": "hi"}  # unset fields stay out
    call = Message("assistant", "x", tool_calls=[{"function": {"name": "f", "arguments": {}}}]).tool_calls[0]
    assert (call.name, call.arguments, call.id) == ("f", {}, None)
    for bad in ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                {"role": "assistant", "tool_calls": [{"type": "function"}]},
                {"role": "robot", "content": "x"}, "not a message"):
        with pytest.raises(ValueError):
            Message.from_openai(bad)


TOOLS_TEMPLATE = (
    "{%- set ns = namespace(calls=0, _ok=1) if false else namespace(calls=0) %}"
    "{%- if tools %}TOOLS{{ tools | tojson }}{% endif %}"
    "{%- for m in messages %}[{{ m.role }}]{{ m.content if m.content is defined else '<none>' }}"
    "{%- if m.reasoning_content is defined %}(think:{{ m.reasoning_content }}|{{ m.thinking }}){% endif %}"
    "{%- for c in m.tool_calls or [] %}{% set ns.calls = ns.calls + 1 %}"
    "<call {{ c.function.name }} {{ c.function.arguments | tojson }} id={{ c.id }}>{% endfor %}"
    "{%- if m.tool_call_id is defined %}(for {{ m.tool_call_id }} {{ m.name }}){% endif %}{% endfor %}"
    "{{ dict(calls=ns.calls) | tojson }}{{ dict.fromkeys(['k']) | tojson }}"
    "{%- if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{%- if add_generation_prompt %}>>{% endif %}"
)


def test_render_chat_with_tools_and_template_kwargs_matches_transformers():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_raw_byte_level(), chat_template=TOOLS_TEMPLATE,
                                              bos_token="<s>", eos_token="<|im_end|>")
    tools = [{"type": "function", "function": {"name": "f", "description": "<é> & \"q\"",
                                               "parameters": {"type": "object", "properties": {}}}}]
    conversation = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c1", "name": "f"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True,
                                          **kwargs)
        got = render_chat(TOOLS_TEMPLATE, [Message.from_openai(m) for m in conversation], add_generation_prompt=True,
                          bos_token="<s>", eos_token="<|im_end|>", tools=tools, template_kwargs=kwargs)
        assert got == expected
        assert render_chat(TOOLS_TEMPLATE, conversation, add_generation_prompt=True, bos_token="<s>",
                           eos_token="<|im_end|>", tools=tools, template_kwargs=kwargs) == expected
    with pytest.raises(ChatTemplateError):  # namespaces refuse underscore names, as transformers' do
        render_chat("{% set ns = namespace(_x=1) %}", [], add_generation_prompt=False)


def test_named_templates_are_picked_like_transformers():
    transformers = pytest.importorskip("transformers")
    named = {"default": "D{{ tools is none }}", "tool_use": "T{{ tools | length }}"}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_raw_byte_level(), chat_template=named)
    msgs = [{"role": "user", "content": "x"}]
    for tools in (None, [{"type": "function", "function": {"name": "f"}}]):
        assert render_chat(named, msgs, add_generation_prompt=False, tools=tools) == \
            hf.apply_chat_template(msgs, tools=tools, tokenize=False)
    with pytest.raises(ChatTemplateError, match="no default"):
        render_chat({"a": "x"}, msgs, add_generation_prompt=False)


def test_chat_format_tools_need_a_template():
    from tokenizers import Tokenizer as HF

    from staticlm.runtime.chat import ChatFormat
    from staticlm.runtime.text.tokenizer import Tokenizer

    tok = Tokenizer(HF.from_str(tiny_tokenizer_json()), bos_token_id=BOS, eos_token_ids=[EOS])
    plain = ChatFormat(tokenizer=tok, chat_template=None, bos_token=None, eos_token=None)
    assert plain.render([Message("user", "hi")]) == "user: hi\nassistant: "
    assert not plain.supports_tools
    with pytest.raises(ValueError, match="tools"):
        plain.prompt_ids([Message("user", "hi")], tools=[{"type": "function", "function": {"name": "f"}}])
    fmt = ChatFormat(tokenizer=tok, chat_template=CHATML, bos_token="<s>", eos_token="<|im_end|>")
    ids = fmt.prompt_ids([{"role": "user", "content": "hi"}], system_prompt="be brief")
    assert ids == tok.encode(fmt.render([Message("user", "hi")], system_prompt="be brief"), add_special_tokens=False)


def test_fitted_prompt_keeps_the_leading_system_message_and_the_tools():
    from tokenizers import Tokenizer as HF

    from staticlm.runtime.chat import ChatFormat
    from staticlm.runtime.text.tokenizer import Tokenizer

    tok = Tokenizer(HF.from_str(tiny_tokenizer_json()), bos_token_id=BOS, eos_token_ids=[EOS])
    template = "{% if tools %}T{{ tools | length }}|{% endif %}" + CHATML
    fmt = ChatFormat(tokenizer=tok, chat_template=template, bos_token="<s>", eos_token="<|im_end|>")
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "system", "content": "RULES"}, Message("user", "old " * 50), Message("assistant", "a " * 50),
                Message("user", "question?")]
    full = fmt.prompt_ids(messages, tools=tools)
    ids, dropped = fmt.fitted_prompt_ids(messages, system_prompt=None, max_tokens=len(full) - 10, tools=tools)
    text = tok.decode(ids)
    assert dropped == len(full) - len(ids) > 0
    assert text.startswith("T1|") and "RULES" in text and "question?" in text and "old" not in text
