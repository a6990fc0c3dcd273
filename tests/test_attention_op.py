"""staticlm's attention ops (runtime/kernels/attention_ops.c), run by ONNX Runtime.

The reference is the naive one: each sequence's rows concatenated in numpy, scores, softmax and the weighted sum in
float64. The ops' own promise, that a row's bits depend only on the rows it sees, is checked between the in-place
op and the segmented one, and between a row run alone and beside others.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from staticlm.runtime import kernels
from staticlm.runtime.session.ort_binding import IOBinding

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_missing())
H, HKV = 6, 2


def _model(node: onnx.NodeProto, inputs: list, outputs: list) -> ort.InferenceSession:
    graph = helper.make_graph([node], node.op_type, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(kernels.DOMAIN, 1)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    kernels.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _info(name: str, dtype: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, None)


def cached_session(*, d: int, half: bool, window: int = 0) -> ort.InferenceSession:
    kv = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    node = helper.make_node("CachedAttentionF16" if half else "CachedAttention",
                            ["q", "k", "v", "past_key", "past_value", "seqlens_k", "query_lengths"],
                            ["out", "present_key", "present_value"], domain=kernels.DOMAIN, num_heads=H,
                            kv_num_heads=HKV, scale=float(d) ** -0.5, window=window)
    inputs = [_info(n, TensorProto.FLOAT) for n in "qkv"] + [_info("past_key", kv), _info("past_value", kv),
                                                              _info("seqlens_k", TensorProto.INT32),
                                                              _info("query_lengths", TensorProto.INT32)]
    outputs = [_info("out", TensorProto.FLOAT), _info("present_key", kv), _info("present_value", kv)]
    return _model(node, inputs, outputs)


def segment_session(*, d: int, half: bool) -> ort.InferenceSession:
    kv = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    prompt = [f"prompt_key_{h}" for h in range(HKV)] + [f"prompt_value_{h}" for h in range(HKV)]
    node = helper.make_node("SegmentAttentionF16" if half else "SegmentAttention",
                            ["q", "k", "v", "bias", "past_key", "past_value", *prompt], ["out"],
                            domain=kernels.DOMAIN, num_heads=H, kv_num_heads=HKV, scale=float(d) ** -0.5)
    inputs = ([_info(n, TensorProto.FLOAT) for n in ("q", "k", "v", "bias")]
              + [_info(n, kv) for n in ("past_key", "past_value", *prompt)])
    return _model(node, inputs, [_info("out", TensorProto.FLOAT)])


def naive(q, keys, values, *, d: int) -> np.ndarray:
    """q [H, D] at one position; keys/values [Hkv, n, D]: the rows it sees -> [H, D] (float64)."""
    g = H // HKV
    out = np.zeros((H, d))
    for head in range(H):
        k, v = keys[head // g].astype(np.float64), values[head // g].astype(np.float64)
        s = k @ q[head].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out[head] = p @ v / p.sum()
    return out


def step_inputs(rng, *, b: int, s: int, d: int, capacity: int, before: list[int], num_new: list[int], half: bool):
    dtype = np.float16 if half else np.float32
    q = rng.standard_normal((b, s, H * d)).astype(np.float32)
    k = rng.standard_normal((b, s, HKV * d)).astype(np.float32)
    v = rng.standard_normal((b, s, HKV * d)).astype(np.float32)
    past_k = rng.standard_normal((b, HKV, capacity, d)).astype(dtype)
    past_v = rng.standard_normal((b, HKV, capacity, d)).astype(dtype)
    lengths = np.array(num_new, np.int32)
    seqlens = np.array(before, np.int32) + lengths - 1
    return dict(q=q, k=k, v=v, past_key=past_k, past_value=past_v, seqlens_k=seqlens, query_lengths=lengths)


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("d,window", [(16, 0), (64, 0), (12, 0), (64, 3)])
def test_cached_attention_matches_the_concatenated_cache(half, d, window):
    rng = np.random.default_rng(d + window + half)
    before, num_new, s, cap = [5, 0, 9], [6, 2, 5], 6, 16  # two blocks of rows (BLOCK_ROWS), padding rows
    feeds = step_inputs(rng, b=3, s=s, d=d, capacity=cap, before=before, num_new=num_new, half=half)
    out, present_k, present_v = cached_session(d=d, half=half, window=window).run(None, feeds)
    dtype = np.float16 if half else np.float32
    for b in range(3):
        n0 = before[b]
        # the buffer: the past rows kept, the new ones written after them in the cache's type, the rest untouched
        new_k = feeds["k"][b, :num_new[b]].reshape(num_new[b], HKV, d).transpose(1, 0, 2).astype(dtype)
        new_v = feeds["v"][b, :num_new[b]].reshape(num_new[b], HKV, d).transpose(1, 0, 2).astype(dtype)
        want_k = feeds["past_key"][b].copy()
        want_k[:, n0:n0 + num_new[b]] = new_k
        want_v = feeds["past_value"][b].copy()
        want_v[:, n0:n0 + num_new[b]] = new_v
        np.testing.assert_array_equal(present_k[b], want_k)
        np.testing.assert_array_equal(present_v[b], want_v)
        for r in range(s):
            got = out[b, r].reshape(H, d)
            if r >= num_new[b]:
                assert not got.any(), "a padding row's output is zeros"
                continue
            last = n0 + r
            first = max(0, last + 1 - window) if window else 0
            want = naive(feeds["q"][b, r].reshape(H, d), want_k[:, first:last + 1], want_v[:, first:last + 1], d=d)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_cached_attention_writes_a_buffer_bound_in_place_and_refuses_rows_past_its_end():
    rng = np.random.default_rng(7)
    d, cap = 32, 8
    feeds = step_inputs(rng, b=1, s=2, d=d, capacity=cap, before=[4], num_new=[2], half=False)
    sess = cached_session(d=d, half=False)
    binding = IOBinding(sess)
    buffers = {n: np.ascontiguousarray(feeds[n]) for n in ("past_key", "past_value")}
    before = {n: a.copy() for n, a in buffers.items()}
    for name, array in feeds.items():
        binding.bind_input(name, buffers.get(name, array))
    binding.bind_output("present_key", buffers["past_key"])
    binding.bind_output("present_value", buffers["past_value"])
    out = np.zeros((1, 2, H * d), np.float32)
    binding.bind_output("out", out)
    binding.run()
    new_k = feeds["k"][0].reshape(2, HKV, d).transpose(1, 0, 2)
    np.testing.assert_array_equal(buffers["past_key"][0, :, 4:6], new_k)
    np.testing.assert_array_equal(buffers["past_key"][0, :, :4], before["past_key"][0, :, :4])
    feeds["seqlens_k"] = np.array([cap], np.int32)  # rows 7 and 8 of an 8-row buffer
    with pytest.raises(Exception, match="do not fit its buffer"):
        sess.run(None, feeds)


@pytest.mark.parametrize("half", [False, True])
def test_a_row_gets_the_same_bits_alone_beside_others_and_through_the_segments(half):
    """The lane holds a sequence's prompt and response rows in one buffer; a segmented graph reads the prompt from
    the shared segment and the response rows from its own buffer, the bias masking its padding. Same rows seen in
    the same order: the same bits. And a row run alone gives the bits it gets beside other rows and sequences."""
    rng = np.random.default_rng(11)
    d, num_prompt, num_response, s = 64, 7, 5, 3
    dtype = np.float16 if half else np.float32
    lane = step_inputs(rng, b=1, s=s, d=d, capacity=32, before=[num_prompt + num_response], num_new=[s], half=half)
    out_lane = cached_session(d=d, half=half).run(None, lane)[0]

    # the same step in sequence 1 of 2 of a segmented graph with a 9-row response buffer
    past = 9
    pk, pv = lane["past_key"][0], lane["past_value"][0]  # [Hkv, C, D]
    other = rng.standard_normal((HKV, past, d)).astype(dtype)
    resp_k = np.stack([other, np.concatenate([pk[:, num_prompt:num_prompt + num_response],
                                              rng.standard_normal((HKV, past - num_response, d)).astype(dtype)], 1)])
    resp_v = np.stack([other, np.concatenate([pv[:, num_prompt:num_prompt + num_response],
                                              rng.standard_normal((HKV, past - num_response, d)).astype(dtype)], 1)])
    bias = np.full((2, 1, s, past + s), -np.inf, np.float32)
    bias[0, 0, :, :3] = 0
    bias[1, 0, :, :num_response] = 0
    for r in range(s):
        bias[:, 0, r, past:past + r + 1] = 0
    feeds = {n: np.concatenate([rng.standard_normal(lane[n].shape).astype(np.float32), lane[n]])
             for n in ("q", "k", "v")}
    feeds.update(bias=bias, past_key=resp_k, past_value=resp_v)
    for h in range(HKV):
        feeds[f"prompt_key_{h}"] = np.ascontiguousarray(pk[h, :num_prompt])
        feeds[f"prompt_value_{h}"] = np.ascontiguousarray(pv[h, :num_prompt])
    out_segment = segment_session(d=d, half=half).run(None, feeds)[0]
    np.testing.assert_array_equal(out_segment[1], out_lane[0])

    # the last row alone (the rows before it cached): the bits it had as the third row of a chunk
    alone = {n: a.copy() for n, a in lane.items()}
    alone["past_key"][0, :, num_prompt + num_response:num_prompt + num_response + 2] = \
        lane["k"][0, :2].reshape(2, HKV, d).transpose(1, 0, 2).astype(dtype)
    alone["past_value"][0, :, num_prompt + num_response:num_prompt + num_response + 2] = \
        lane["v"][0, :2].reshape(2, HKV, d).transpose(1, 0, 2).astype(dtype)
    for n in ("q", "k", "v"):
        alone[n] = np.ascontiguousarray(lane[n][:, 2:])
    alone["query_lengths"] = np.array([1], np.int32)
    out_alone = cached_session(d=d, half=half).run(None, alone)[0]
    np.testing.assert_array_equal(out_alone[0, 0], out_lane[0, 2])
