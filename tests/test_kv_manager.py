"""kv_manager against a naive reference: a Python list of committed rows per sequence."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staticlm.kv_manager import (
    MASK_VALUE,
    ContextFull,
    KVSpec,
    Overflow,
    Strategy,
    attention_bias,
    choose_bmc_r,
    dequantize_bias,
    kv_bytes,
    make_kv_cache,
    quantize_bias,
)

ALL = [s for s in Strategy if s is not Strategy.IN_PLACE]  # the window strategies


class NaiveKV:
    """The reference: every committed row, in order, per sequence; nothing clever."""

    def __init__(self, batch: int) -> None:
        self.rows: list[list[np.ndarray]] = [[] for _ in range(batch)]
        self.dropped = [0] * batch


def _spec(**kw) -> KVSpec:
    base = dict(num_tensors=3, head_dim=4, dtype="float32", max_past=15, max_ar=4, max_positions=10_000)
    base.update(kw)
    return KVSpec(**base)


def _step(cache, ref: NaiveKV, *, past_len: int, ar: int, commits: list[int], rng) -> None:
    cache.prepare(past_len=past_len, ar=ar)
    for b in range(cache.spec.batch):
        new = rng.standard_normal((cache.spec.num_tensors, ar, cache.spec.head_dim)).astype(cache.spec.dtype)
        for t in range(cache.spec.num_tensors):
            cache.slot(t, b, ar)[0, 0] = new[t]  # what the graph's output binding does
        for i in range(commits[b]):
            ref.rows[b].append(new[:, i])
    cache.advance(np.array(commits))


def _check(cache, ref: NaiveKV, past_len: int) -> None:
    for b in range(cache.spec.batch):
        n = int(cache.lengths[b])
        expected = ref.rows[b][len(ref.rows[b]) - n:] if n else []
        assert n == len(ref.rows[b])
        assert int(cache.positions[b]) == len(ref.rows[b]) + ref.dropped[b]
        for t in range(cache.spec.num_tensors):
            window = cache.window(t, b, past_len)
            assert window.shape == (1, 1, past_len, cache.spec.head_dim)
            valid = window[0, 0, past_len - min(n, past_len):]
            want = np.array([row[t] for row in expected[len(expected) - min(n, past_len):]]).reshape(valid.shape)
            np.testing.assert_array_equal(valid, want)


ops = st.lists(st.tuples(st.sampled_from(["step", "step", "step", "truncate", "reset"]),
                         st.integers(0, 10_000)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(strategy=st.sampled_from(ALL), reserve=st.floats(1.1, 3.0), batch=st.integers(1, 3), ops=ops,
       seed=st.integers(0, 2**16))
def test_windows_match_naive_reference(strategy, reserve, batch, ops, seed):
    rng = np.random.default_rng(seed)
    spec = _spec(reserve=reserve, batch=batch, overflow=Overflow.SLIDE)
    cache = make_kv_cache(spec, strategy, bmc_r=4)
    ref = NaiveKV(batch)
    for op, x in ops:
        if op == "step":
            ar = 1 + x % spec.max_ar
            past_len = spec.max_past if x % 3 else max(1, spec.max_past - 1 - x % 7)
            commits = [int(v) for v in rng.integers(0, ar + 1, batch)]
            # Slide: rows beyond the window are forgotten before the step, like the cache does.
            for b in range(batch):
                excess = len(ref.rows[b]) - past_len
                if excess > 0:
                    ref.dropped[b] += excess
                    del ref.rows[b][:excess]
            _step(cache, ref, past_len=past_len, ar=ar, commits=commits, rng=rng)
            cache.prepare(past_len=spec.max_past, ar=1)
            for b in range(batch):
                excess = len(ref.rows[b]) - spec.max_past
                if excess > 0:
                    ref.dropped[b] += excess
                    del ref.rows[b][:excess]
            _check(cache, ref, spec.max_past)
        elif op == "truncate":
            b = x % batch
            keep = x % (int(cache.lengths[b]) + 1)
            cache.truncate(keep, seq=b)
            del ref.rows[b][keep:]
            cache.prepare(past_len=spec.max_past, ar=1)
            _check(cache, ref, spec.max_past)
        else:
            cache.reset()
            ref = NaiveKV(batch)
            cache.prepare(past_len=spec.max_past, ar=1)
            _check(cache, ref, spec.max_past)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), heads=st.sampled_from([1, 2]), ops=ops, seed=st.integers(0, 2**16))
def test_in_place_rows_match_naive_reference(batch, heads, ops, seed):
    # The in-place layout: [B, H, rows, D] buffers per (layer, K|V); the graph (here: this test) writes each
    # step's rows at row `length` of every buffer, and the committed rows always start at row 0.
    rng = np.random.default_rng(seed)
    spec = _spec(num_tensors=2 * 2 * heads, batch=batch, overflow=Overflow.SLIDE, heads_per_buffer=heads)
    cache, ref = make_kv_cache(spec, Strategy.IN_PLACE), NaiveKV(batch)
    num_slides = 0

    def slide() -> None:  # what prepare does first: a sequence over the window keeps its newest max_past * 7/8 rows
        nonlocal num_slides
        for b in range(batch):
            if len(ref.rows[b]) > spec.max_past:
                drop = len(ref.rows[b]) - (spec.max_past - spec.max_past // 8)
                ref.dropped[b] += drop
                del ref.rows[b][:drop]
                num_slides += 1

    for op, x in ops:
        if op == "step":
            ar = 1 + x % spec.max_ar
            slide()
            cache.prepare(past_len=spec.max_past, ar=ar)
            commits = [int(v) for v in rng.integers(0, ar + 1, batch)]
            buffers = cache.buffers()
            for b in range(batch):
                length = int(cache.lengths[b])
                new = rng.standard_normal((spec.num_tensors, ar, spec.head_dim)).astype(np.float32)
                for t in range(spec.num_tensors):
                    g, h = layer_kv_head(t, heads)
                    buffers[g][b, h, length:length + ar] = new[t]  # what GroupQueryAttention's present output does
                    assert np.shares_memory(cache.slot(t, b, ar), buffers[g][b, h, length:length + ar])
                ref.rows[b] += [new[:, i] for i in range(commits[b])]
            cache.advance(np.array(commits))
        elif op == "truncate":
            b = x % batch
            keep = x % (int(cache.lengths[b]) + 1)
            cache.truncate(keep, seq=b)
            del ref.rows[b][keep:]
        else:
            cache.reset()
            ref = NaiveKV(batch)
        slide()
        cache.prepare(past_len=spec.max_past, ar=1)
        for b in range(batch):
            assert int(cache.ends[b]) == int(cache.lengths[b]) == len(ref.rows[b])  # rows start at row 0
            assert int(cache.positions[b]) == len(ref.rows[b]) + ref.dropped[b]
            for t in range(spec.num_tensors):
                want = np.array([row[t] for row in ref.rows[b]]).reshape(-1, spec.head_dim)
                np.testing.assert_array_equal(cache.valid_rows(t, b), want)
    assert cache.stats.num_allocations == 1
    if num_slides == 0:
        assert cache.stats.copied_rows == 0  # appending never copies


def layer_kv_head(tensor: int, heads: int) -> tuple[int, int]:
    """kv_tensor_index order (layer, head, K then V) -> (buffer = 2 layer + V, head), written out independently."""
    layer, head, is_value = tensor // (2 * heads), (tensor // 2) % heads, tensor % 2
    return 2 * layer + is_value, head


@pytest.mark.parametrize("strategy", ALL)
def test_error_policy_raises_with_numbers_and_keeps_state(strategy, rng):
    spec = _spec(max_past=6, max_ar=2)
    cache, ref = make_kv_cache(spec, strategy, bmc_r=2), NaiveKV(1)
    for _ in range(7):
        _step(cache, ref, past_len=6, ar=1, commits=[1], rng=rng)
    with pytest.raises(ContextFull, match="7 tokens cached.*holds 6"):
        cache.prepare(past_len=6, ar=1)
    assert int(cache.lengths[0]) == 7  # nothing was dropped by the failed step
    cache.truncate(5)
    del ref.rows[0][5:]
    cache.prepare(past_len=6, ar=1)  # windows are defined between prepare and advance
    _check(cache, ref, 6)


def test_slide_keeps_counting_positions_then_stops_at_the_model_maximum(rng):
    spec = _spec(max_past=4, max_ar=1, max_positions=9, overflow=Overflow.SLIDE)
    cache, ref = make_kv_cache(spec, Strategy.POINTER), NaiveKV(1)
    for _ in range(9):
        excess = len(ref.rows[0]) - 4
        if excess > 0:
            ref.dropped[0] += excess
            del ref.rows[0][:excess]
        _step(cache, ref, past_len=4, ar=1, commits=[1], rng=rng)
    assert int(cache.positions[0]) == 9 and int(cache.lengths[0]) == 5
    with pytest.raises(ContextFull, match="9 positions"):
        cache.prepare(past_len=4, ar=1)


def test_pointer_copies_once_per_s_minus_1_tokens_with_reserve_2(rng):
    s_minus_1 = 31
    spec = _spec(max_past=s_minus_1, max_ar=1, reserve=2.0, overflow=Overflow.SLIDE)
    cache, ref = make_kv_cache(spec, Strategy.POINTER), NaiveKV(1)
    bytes_per_row = spec.num_tensors * spec.head_dim * spec.itemsize
    for i in range(3 * s_minus_1):
        _step(cache, ref, past_len=min(s_minus_1, max(1, i)), ar=1, commits=[1], rng=rng)
        if i < s_minus_1:
            assert cache.stats.copied_bytes == 0 and cache.stats.num_compactions == 0
    # Compactions happen at tokens S-1+1 and 2(S-1)+1; each moves exactly one window of S-1 rows.
    assert cache.stats.num_compactions == 2
    assert cache.stats.copied_rows == 2 * s_minus_1
    assert cache.stats.copied_bytes == 2 * s_minus_1 * bytes_per_row
    assert cache.stats.num_allocations == 1
    assert cache.stats.reserved_bytes == spec.num_tensors * 2 * s_minus_1 * spec.head_dim * spec.itemsize


def test_reserve_1_5_compacts_more_often_with_less_memory(rng):
    counts = {}
    for reserve in (2.0, 1.5):
        spec = _spec(max_past=40, max_ar=1, reserve=reserve, overflow=Overflow.SLIDE)
        cache, ref = make_kv_cache(spec, Strategy.POINTER), NaiveKV(1)
        for _ in range(200):
            _step(cache, ref, past_len=40, ar=1, commits=[1], rng=rng)
        counts[reserve] = (cache.stats.num_compactions, cache.stats.reserved_bytes)
    assert counts[1.5][0] > counts[2.0][0]
    assert counts[1.5][1] == counts[2.0][1] * 3 // 4


def test_concat_copies_quadratically_and_shift_linearly(rng):
    n = 20
    results = {}
    for strategy in (Strategy.CONCAT, Strategy.SHIFT):
        spec = _spec(max_past=n + 1, max_ar=1)
        cache, ref = make_kv_cache(spec, strategy), NaiveKV(1)
        for _ in range(n):
            _step(cache, ref, past_len=n + 1, ar=1, commits=[1], rng=rng)
        results[strategy] = cache.stats
    assert results[Strategy.CONCAT].copied_rows == n * (n - 1) // 2  # 0 + 1 + ... + (n-1)
    assert results[Strategy.CONCAT].num_allocations == n + 1
    assert results[Strategy.SHIFT].copied_rows == n * (n + 2)  # the full buffer (window + margin), every token


def test_bmc_reallocates_every_r_tokens(rng):
    spec = _spec(max_past=32, max_ar=1, overflow=Overflow.SLIDE)
    cache, ref = make_kv_cache(spec, Strategy.BMC, bmc_r=8), NaiveKV(1)
    for _ in range(64):
        _step(cache, ref, past_len=32, ar=1, commits=[1], rng=rng)
    assert cache.stats.num_allocations == 1 + 64 // 8 - 1
    assert cache.stats.num_compactions == 64 // 8 - 1


def test_window_and_slot_share_the_buffer(rng):
    spec = _spec(max_past=8, max_ar=2)
    cache = make_kv_cache(spec, Strategy.POINTER)
    cache.prepare(past_len=8, ar=2)
    slot, window = cache.slot(1, 0, 2), cache.window(1, 0, 8)
    assert slot.flags.c_contiguous and window.flags.c_contiguous
    row_bytes = spec.head_dim * spec.itemsize
    assert slot.ctypes.data == window.ctypes.data + 8 * row_bytes  # the slot is the row right after the window
    assert np.shares_memory(slot, cache._buf)
    slot[0, 0] = 7.0
    cache.advance(2)
    cache.prepare(past_len=8, ar=1)
    np.testing.assert_array_equal(cache.window(1, 0, 8)[0, 0, -2:], 7.0)
    addresses = cache.window_addresses(8)
    assert addresses.shape == (spec.num_tensors, 1)
    for t in range(spec.num_tensors):
        assert addresses[t, 0] == cache.window(t, 0, 8).ctypes.data
        assert cache.slot_addresses(1)[t, 0] == cache.slot(t, 0, 1).ctypes.data


@pytest.mark.parametrize("dtype", ["float16", "uint8", "uint16"])
def test_quantized_kv_is_stored_raw(dtype, rng):
    spec = _spec(dtype=dtype, max_past=5, max_ar=1)
    cache = make_kv_cache(spec, Strategy.POINTER)
    cache.prepare(past_len=5, ar=1)
    value = np.arange(spec.head_dim).astype(dtype) + 3
    cache.slot(0, 0, 1)[0, 0, 0] = value
    cache.advance(1)
    assert cache.window(0, 0, 5).dtype == np.dtype(dtype)
    np.testing.assert_array_equal(cache.window(0, 0, 5)[0, 0, -1], value)


@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=3), ar=st.integers(1, 5))
def test_attention_bias(lengths, ar):
    past_len = 10
    bias = attention_bias(lengths=np.array(lengths), past_len=past_len, ar=ar)
    assert bias.shape == (len(lengths), 1, ar, past_len + ar)
    assert np.isfinite(bias).all()
    for b, n in enumerate(lengths):
        for i in range(ar):
            for j in range(past_len + ar):
                visible = (past_len - min(n, past_len) <= j < past_len) or (past_len <= j <= past_len + i)
                assert bias[b, 0, i, j] == (0.0 if visible else MASK_VALUE)
    for dtype in (np.uint8, np.uint16):
        np.testing.assert_allclose(dequantize_bias(quantize_bias(bias, dtype=dtype)), bias, atol=1e-3)


def test_attention_bias_writes_in_place():
    out = np.zeros((1, 1, 1, 9), np.float32)
    result = attention_bias(lengths=np.array([3]), past_len=8, ar=1, out=out)
    assert result is out
    np.testing.assert_array_equal(out[0, 0, 0] == 0, [False] * 5 + [True] * 4)


def test_kv_bytes_reproduces_the_design_note():
    llama7b = dict(num_layers=32, num_kv_heads=32, context=2048, head_dim=128, bits=16)
    assert kv_bytes(**llama7b) == 2_146_435_072
    assert kv_bytes(**llama7b, reserve=1.5) == 1_609_826_304
    # GQA: 8 KV heads need a quarter.
    assert kv_bytes(**{**llama7b, "num_kv_heads": 8}) == 2_146_435_072 // 4


def test_choose_bmc_r_follows_the_analytical_model():
    assert choose_bmc_r(max_context=512, c_prime=0.1) == 512 // 8  # the paper's T = 8 at N = 512
    assert choose_bmc_r(max_context=2048, c_prime=0.1) == 2048 // 16
    assert choose_bmc_r(max_context=512, copy_bandwidth=2.0, compute_rate=10.0) == 64
    with pytest.raises(ValueError):
        choose_bmc_r(max_context=512)


def test_bad_spec_and_bad_advance_are_refused():
    with pytest.raises(ValueError):
        _spec(reserve=1.0)
    cache = make_kv_cache(_spec(), Strategy.POINTER)
    cache.prepare(past_len=15, ar=2)
    with pytest.raises(ValueError):
        cache.advance(3)
    with pytest.raises(ValueError):
        cache.truncate(1)


def test_kv_manager_does_not_import_onnxruntime():
    import subprocess
    import sys

    code = "import sys, staticlm.kv_manager; sys.exit('onnxruntime' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from([*Strategy, "response"]), layered=st.booleans(), window=st.integers(2, 5),
       batch=st.integers(1, 3), ops=st.lists(st.tuples(st.sampled_from(["step", "step", "truncate", "rewind"]),
                                                     st.integers(0, 10_000)), min_size=1, max_size=40),
       seed=st.integers(0, 2**16))
def test_truncate_keeps_the_first_rows_whenever_can_truncate_says_so(kind, layered, window, batch, ops, seed):
    """Every cache class answers can_truncate(n); where it says yes, truncate(n) leaves exactly the reference's first
    n rows (a local layer of a LayeredKVCache: the newest of them, at least its window's); where it says no, truncate
    refuses and changes nothing. A plain cache says yes exactly when every sequence asked about holds n rows.
    rewind([B] counts), the paired decode's one call for every row, does what one truncate per row would."""
    from staticlm.kv_manager import LayeredKVCache
    from staticlm.kv_manager.segments import ResponseCache

    rng = np.random.default_rng(seed)
    layered = layered and kind != "response"
    spec = _spec(num_tensors=4, max_past=14, max_ar=3, batch=batch)
    local = [layered and t < 2 for t in range(spec.num_tensors)]  # layer 0 local (K, V), layer 1 global
    if kind == "response":
        cache = ResponseCache(spec, step=4)
    else:
        cache = make_kv_cache(spec, kind, bmc_r=3, local=local if layered else (), window=window)
    assert isinstance(cache, LayeredKVCache) == layered
    ref: list[list[np.ndarray]] = [[] for _ in range(batch)]  # per sequence, every committed row [T, D]

    def check() -> None:
        for b in range(batch):
            assert int(cache.lengths[b]) == len(ref[b])
            for t in range(spec.num_tensors):
                want = np.array([row[t] for row in ref[b]]).reshape(-1, spec.head_dim)  # [n, D]
                valid = cache.valid_rows(t, b)
                if local[t]:  # the newest rows only, at least the W-1 a window reads
                    assert min(len(want), window - 1) <= len(valid) <= len(want)
                    want = want[len(want) - len(valid):]
                np.testing.assert_array_equal(valid, want)

    for op, x in ops:
        if op == "step":
            ar = 1 + x % spec.max_ar
            if max(map(len, ref)) + ar > spec.max_past:
                continue  # the error policy would refuse it: the reference keeps every row
            cache.prepare(past_len=spec.max_past, ar=ar)
            commits = rng.integers(0, ar + 1, batch)
            new = rng.standard_normal((batch, spec.num_tensors, ar, spec.head_dim)).astype(np.float32)
            for b in range(batch):
                for t in range(spec.num_tensors):
                    cache.slot(t, b, ar)[0, 0] = new[b, t]  # what the graph's output binding does
                ref[b] += [new[b, :, i] for i in range(commits[b])]
            cache.advance(commits)
        elif op == "rewind":
            num_rows = np.array([(x >> (4 * b)) % (len(ref[b]) + 2) for b in range(batch)])  # 0 .. length + 1
            can = cache.can_rewind(num_rows)
            fits = all(num_rows[b] <= len(ref[b]) for b in range(batch))
            assert can == fits if not layered else (fits or not can)
            assert can == all(cache.can_truncate(len(ref[b]) - int(num_rows[b]), b) for b in range(batch))
            if can:
                cache.rewind(num_rows)
                for b in range(batch):
                    del ref[b][len(ref[b]) - int(num_rows[b]):]
            else:
                with pytest.raises(ValueError):
                    cache.rewind(num_rows)
        else:
            seq = None if x % 3 == 0 else (x // 3) % batch
            seqs = range(batch) if seq is None else (seq,)
            n = (x // 7) % (max(map(len, ref)) + 3) - 1  # -1 .. longest + 1
            can = cache.can_truncate(n, seq)
            fits = n >= 0 and all(n <= len(ref[b]) for b in seqs)
            assert can == fits if not layered else (fits or not can)
            for b in range(batch):  # keeping every row is always possible
                assert cache.can_truncate(len(ref[b]), b)
            if can:
                cache.truncate(n, seq)
                for b in seqs:
                    del ref[b][n:]
            else:
                with pytest.raises(ValueError):
                    cache.truncate(n, seq)
        check()


@pytest.mark.parametrize("strategy", list(Strategy))
def test_a_refused_truncate_of_every_sequence_changes_none(strategy, rng):
    spec = _spec(batch=2, max_ar=4)
    cache, ref = make_kv_cache(spec, strategy, bmc_r=3), NaiveKV(2)
    _step(cache, ref, past_len=spec.max_past, ar=4, commits=[4, 1], rng=rng)
    assert cache.can_truncate(3, 0) and not cache.can_truncate(3)
    with pytest.raises(ValueError, match="sequence 1 from 1 to 3"):
        cache.truncate(3)
    assert cache.lengths.tolist() == [4, 1]
    for b in range(2):
        for t in range(spec.num_tensors):
            np.testing.assert_array_equal(cache.valid_rows(t, b), np.array([row[t] for row in ref.rows[b]]))
