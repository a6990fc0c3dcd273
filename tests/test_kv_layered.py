"""Per-layer window lengths (kv_manager/layered.py) against a naive concatenated cache: every row ever written, per
tensor; a local tensor's window must be the newest min(P, W-1) of them, a global one's the newest P."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from staticlm.kv_manager import MASK_VALUE, KVSpec, LayeredKVCache, Overflow, Strategy, attention_bias, make_kv_cache

# 3 layers x 2 KV heads x K/V; layer 1 is global, layers 0 and 2 local
HEADS, LAYERS, LOCAL_LAYERS = 2, 3, (0, 2)
LOCAL = [t // (2 * HEADS) in LOCAL_LAYERS for t in range(2 * HEADS * LAYERS)]
ops = st.lists(st.tuples(st.sampled_from(["step", "step", "step", "step", "rewind", "reset"]),
                         st.integers(0, 10_000)), min_size=1, max_size=50)


def _layer_buffer_head(tensor: int) -> tuple[int, int]:
    """(layer, head, K then V) -> (buffer = 2 layer + V, head), written out independently of the spec."""
    return 2 * (tensor // (2 * HEADS)) + tensor % 2, (tensor // 2) % HEADS


@settings(max_examples=80, deadline=None)
@given(strategy=st.sampled_from(list(Strategy)), window=st.integers(2, 9), batch=st.integers(1, 2), ops=ops,
       seed=st.integers(0, 2**16))
def test_layered_windows_match_a_concatenated_cache(strategy, window, batch, ops, seed):
    rng = np.random.default_rng(seed)
    in_place = strategy is Strategy.IN_PLACE
    spec = KVSpec(num_tensors=len(LOCAL), head_dim=3, dtype="float32", max_past=14, max_ar=4, max_positions=10_000,
                  overflow=Overflow.SLIDE, batch=batch, heads_per_buffer=HEADS if in_place else 1)
    cache = make_kv_cache(spec, strategy, bmc_r=3, local=LOCAL, window=window)
    assert isinstance(cache, LayeredKVCache)
    history = [[] for _ in range(batch)]  # per sequence, every committed row [T, D] in order (nothing dropped)
    # The guarantee: the local class holds min(n, W-1 + max_ar) rows but for the rows rewound since (`debt`), so
    # rewinds of max_ar rows in all always work
    kept_rows, debt = window - 1 + spec.max_ar, [0] * batch
    for op, x in ops:
        if op == "step":
            ar = 1 + x % spec.max_ar
            past_len = spec.max_past if in_place or x % 3 else max(1, spec.max_past - x % 7)
            cache.prepare(past_len=past_len, ar=ar)
            commits = rng.integers(0, ar + 1, batch)
            new = rng.standard_normal((batch, spec.num_tensors, ar, 3)).astype(np.float32)
            if in_place:  # the graph writes at row `length` of each buffer (GroupQueryAttention's present output)
                buffers = cache.buffers()
                for b in range(batch):
                    for t in range(spec.num_tensors):
                        g, h = _layer_buffer_head(t)
                        n = int((cache.local_lengths if LOCAL[t] else cache.lengths)[b])
                        buffers[g][b, h, n:n + ar] = new[b, t]
            else:  # the graph's output binding: the slot right after each window
                for b in range(batch):
                    for t in range(spec.num_tensors):
                        cache.slot(t, b, ar)[0, 0] = new[b, t]
            cache.advance(commits)
            for b in range(batch):
                history[b] += [new[b, :, i] for i in range(commits[b])]
        elif op == "rewind":
            b = x % batch
            num = int(cache.lengths[b])
            keep = num - x % (spec.max_ar + 1)
            if keep >= 0 and debt[b] + num - keep <= spec.max_ar:
                assert cache.can_truncate(keep, b)
            if keep >= 0 and cache.can_truncate(keep, b):
                debt[b] += num - keep
                cache.truncate(keep, b)
                del history[b][len(history[b]) - (num - keep):]  # the history also holds the rows slid out
            far = num - window - spec.max_ar - 2  # further back than the local layers keep: refused, not wrong
            if far >= window and not cache.can_truncate(far, b):
                try:
                    cache.truncate(far, b)
                    raise AssertionError("a rewind past the kept rows was accepted")
                except ValueError:
                    pass
        else:
            cache.reset()
            history, debt = [[] for _ in range(batch)], [0] * batch
        cache.prepare(past_len=spec.max_past, ar=1)
        for b in range(batch):
            rows = np.array(history[b]).reshape(-1, spec.num_tensors, 3)  # [n, T, D]
            # the global class slides past max_past rows; positions keep counting every row
            assert int(cache.positions[b]) == len(rows)
            kept = int(cache.lengths[b])  # the newest rows (a smaller window slid the global class further)
            assert kept <= min(len(rows), spec.max_past)
            local_kept = int(cache.local_lengths[b])
            assert min(len(rows), window - 1) <= local_kept <= cache.retained + spec.max_ar
            assert local_kept >= min(len(rows), kept_rows) - debt[b]
            for t in range(spec.num_tensors):
                n = min(len(rows), window - 1) if LOCAL[t] else kept
                valid = cache.valid_rows(t, b)
                np.testing.assert_array_equal(valid[len(valid) - n:], rows[len(rows) - n:, t])
                if not in_place:
                    p = min(spec.max_past, window - 1) if LOCAL[t] else spec.max_past
                    win = cache.window(t, b, spec.max_past)
                    assert win.shape == (1, 1, p, 3)
                    np.testing.assert_array_equal(win[0, 0, p - n:], rows[len(rows) - n:, t])
    # memory follows the window: the local class never holds more than its retained rows' capacity
    assert cache.retained <= (window - 1 + spec.max_ar) * 8 // 7 + 1
    assert cache.local_cache.capacity <= max(round(spec.reserve * cache.retained), cache.retained + 2 * spec.max_ar)


def test_window_addresses_point_at_each_class_window():
    spec = KVSpec(num_tensors=len(LOCAL), head_dim=3, dtype="float32", max_past=14, max_ar=4, max_positions=100)
    cache = make_kv_cache(spec, Strategy.POINTER, local=LOCAL, window=5)
    for _ in range(3):
        cache.prepare(past_len=14, ar=4)
        cache.advance(4)
    cache.prepare(past_len=14, ar=1)
    addresses, slots = cache.window_addresses(14), cache.slot_addresses(1)
    for t in range(spec.num_tensors):
        assert addresses[t, 0] == cache.window(t, 0, 14).ctypes.data
        assert slots[t, 0] == cache.slot(t, 0, 1).ctypes.data
        assert cache.window(t, 0, 14).shape[2] == (4 if LOCAL[t] else 14)


def _naive_bias(n: int, past_len: int, ar: int, window: int) -> np.ndarray:
    """Row i (position n + i) sees position j iff j <= n + i and n + i - j < window; past row r of the P-row
    window holds position n - P + r (left padding below 0)."""
    out = np.full((ar, past_len + ar), MASK_VALUE, np.float32)
    for i in range(ar):
        q = n + i
        for r in range(past_len):
            j = n - past_len + r
            if j >= max(0, n - past_len) and j >= 0 and q - j < window:
                out[i, r] = 0
        for k in range(i + 1):
            if i - k < window:
                out[i, past_len + k] = 0
    return out


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=3), past_len=st.integers(1, 10),
       ar=st.integers(1, 6), window=st.integers(2, 12))
def test_sliding_bias_matches_positions(lengths, past_len, ar, window):
    got = attention_bias(lengths=np.array(lengths), past_len=past_len, ar=ar, window=window)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(got[b, 0], _naive_bias(n, past_len, ar, window))
    if window > past_len + ar:  # a window wider than the graph: the plain causal mask
        np.testing.assert_array_equal(got, attention_bias(lengths=np.array(lengths), past_len=past_len, ar=ar))
