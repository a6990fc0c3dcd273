"""staticlm's custom ops over GGUF blocks (runtime/kernels): GgufMatMul and GgufGather, run by ONNX Runtime.

References, all independent of the kernels: gguf-py's own dequantization of the same blocks, and the activation
rows quantized in numpy by the rule the kernels state (one int8 scale per activation block, amax / 127, levels
rounded half to even). The vector and the portable dots are both checked.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from onnx import TensorProto, helper
from test_gguf_grids import raw_blocks

from staticlm.runtime import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.why_missing())
TYPES = [T[name] for name in kernels.TYPES]


def op_model(op: str, *, qtype: T, n: int, k: int, x_shape: list, table: np.ndarray | None = None,
             row_group: int = 0) -> bytes:
    """One staticlm op; the weight is an input (GgufMatMul) or an initializer (GgufGather's table)."""
    if op == "GgufMatMul":
        grouping = {"row_group": row_group} if row_group else {}
        node = helper.make_node(op, ["x", "w"], ["y"], domain=kernels.DOMAIN, ggml_type=int(qtype), N=n, K=k,
                                **grouping)
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                  helper.make_tensor_value_info("w", TensorProto.UINT8, None)]
        inits = []
    else:
        node = helper.make_node(op, ["table", "ids"], ["y"], domain=kernels.DOMAIN, ggml_type=int(qtype), K=k)
        inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, x_shape)]
        inits = [onnx.numpy_helper.from_array(table, "table")]
    graph = helper.make_graph([node], op, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(kernels.DOMAIN, 1)])
    model.ir_version = 9
    return model.SerializeToString()


def session(model: bytes, *, threads: int = 2):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    kernels.register(so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def quantized_activations(x: np.ndarray, act_block: int) -> np.ndarray:
    """x [M, K] as the kernels see it: levels round(x * 127 / amax) times amax / 127, per block (float32 rules)."""
    m, k = x.shape
    blocks = x.reshape(m, k // act_block, act_block)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    levels = np.rint(blocks * inv)
    assert np.abs(levels).max() <= 127
    return (levels * (amax / np.float32(127)).astype(np.float32)).reshape(m, k)


def weights(qtype: T, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random valid blocks [N, row bytes] and gguf's dequantization of them [N, K]."""
    rng = np.random.default_rng(seed)
    raw = raw_blocks((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype, rng)
    return raw, dequantize(raw, qtype).reshape(n, k).astype(np.float64)


def grouped(raw: np.ndarray, qtype: T) -> np.ndarray:
    """The blocks [N, row bytes] stored as row_group 8 says (gguf_dot.h), written out byte by byte: each 8 rows'
    blocks interleaved, block b of the group's row j at (8 b + j) blocks from the group's start; for Q4_K and Q6_K
    those 8 blocks as one group block (d, [dmin], scales, then the levels by chunk, eighth, half and slot)."""
    n, row_bytes = raw.shape
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    out = np.empty_like(raw).reshape(-1)
    for row in range(n):
        j = row % 8
        for b in range(row_bytes // block_bytes):
            at = ((row // 8) * (row_bytes // block_bytes) * 8 + b * 8) * block_bytes  # the 8 blocks b of the group
            block = raw[row, b * block_bytes:(b + 1) * block_bytes]
            if qtype == T.Q4_K:
                out[at + 2 * j:at + 2 * j + 2] = block[0:2]  # d
                out[at + 16 + 2 * j:at + 18 + 2 * j] = block[2:4]  # dmin
                for u in range(3):  # the scale bytes' words
                    out[at + 32 + 4 * (8 * u + j):at + 36 + 4 * (8 * u + j)] = block[4 + 4 * u:8 + 4 * u]
                for chunk in range(4):
                    place_levels(out, at + 128 + 256 * chunk, block[16 + 32 * chunk:], j)
            elif qtype == T.Q6_K:
                out[at + 2 * j:at + 2 * j + 2] = block[208:210]  # d
                for s in range(16):
                    out[at + 16 + 8 * s + j] = block[192 + s]
                for t in range(2):  # ql's two 32s of this half, then its qh
                    for part, start in enumerate((64 * t, 64 * t + 32, 128 + 32 * t)):
                        place_levels(out, at + 144 + 768 * t + 256 * part, block[start:], j)
            else:
                out[at + j * block_bytes:at + (j + 1) * block_bytes] = block
    return out.reshape(n, row_bytes)


def place_levels(out: np.ndarray, to: int, levels: np.ndarray, j: int) -> None:
    """32 level bytes of a group's row j at `to`, by eighths: eighth e at 64 e + 32 half + 8 slot (gguf_dot.h)"""
    half, slot = (j >> 1) & 1, (j & 1) | (j >> 2) << 1
    for eighth in range(4):
        at = to + 64 * eighth + 32 * half + 8 * slot
        out[at:at + 8] = levels[8 * eighth:8 * eighth + 8]


@pytest.mark.parametrize("row_group", [0, 8], ids=["rows", "groups"])
@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_equals_ggufs_dequantization_times_the_quantized_activations(qtype, portable, row_group, monkeypatch):
    monkeypatch.setenv("STATICLM_GGUF_PORTABLE", "1" if portable else "0")
    # 45 weight rows: two whole tasks of 16 and one of 13 (grouped: 40, two tasks and one of a single group);
    # 10 activation rows: a whole tile of 8 and one of 2
    n, k, m = 40 if row_group else 45, 768, 10
    raw, w = weights(qtype, n, k, seed=int(qtype))
    act_block = GGML_QUANT_SIZES[qtype][0]
    x = (np.random.default_rng(1).standard_normal((2, m // 2, k)) * np.linspace(0.1, 3, k)).astype(np.float32)
    model = op_model("GgufMatMul", qtype=qtype, n=n, k=k, x_shape=[2, m // 2, k], row_group=row_group)
    got = session(model).run(None, {"x": x, "w": grouped(raw, qtype) if row_group else raw})[0]
    assert got.shape == (2, m // 2, n)
    want = quantized_activations(x.reshape(m, k), act_block).astype(np.float64) @ w.T
    scale = np.abs(quantized_activations(x.reshape(m, k), act_block)) @ np.abs(w).T  # the products' magnitude
    assert np.all(np.abs(got.reshape(m, n) - want) <= 1e-5 * scale + 1e-30)
    # and the activations' rounding is the only loss against float x: within a level per input
    assert np.abs(got.reshape(m, n) - x.reshape(m, k).astype(np.float64) @ w.T).max() < 0.02 * np.abs(want).max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gather_rows_are_ggufs_dequantization_bit_for_bit(qtype):
    n, k = 24, 512
    raw, w = weights(qtype, n, k, seed=7 + int(qtype))
    ids = np.array([[3, 0, 23], [23, 5, 5]], np.int64)
    got = session(op_model("GgufGather", qtype=qtype, n=n, k=k, x_shape=[2, 3], table=raw)).run(None, {"ids": ids})[0]
    assert got.shape == (2, 3, k)
    assert np.array_equal(got, w.astype(np.float32)[ids])


def test_bad_shapes_and_ids_are_errors_not_crashes():
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

    raw, _w = weights(T.Q8_0, 8, 64, seed=3)
    matmul = session(op_model("GgufMatMul", qtype=T.Q8_0, n=8, k=64, x_shape=["m", "k"]))
    with pytest.raises((Fail, InvalidArgument), match="last dimension is not K"):
        matmul.run(None, {"x": np.zeros((1, 32), np.float32), "w": raw})
    with pytest.raises((Fail, InvalidArgument), match="not N rows"):
        matmul.run(None, {"x": np.zeros((1, 64), np.float32), "w": raw[:4]})
    for n, row_group in ((8, 4), (12, 8)):  # the one grouping, over whole groups
        with pytest.raises((Fail, InvalidArgument, RuntimeException), match="row_group must be 0, or 8"):
            session(op_model("GgufMatMul", qtype=T.Q8_0, n=n, k=64, x_shape=["m", "k"], row_group=row_group))
    gather = session(op_model("GgufGather", qtype=T.Q8_0, n=8, k=64, x_shape=[1], table=raw))
    with pytest.raises((Fail, InvalidArgument), match="out of the table's range"):
        gather.run(None, {"ids": np.array([8], np.int64)})


def test_zero_rows_and_one_thread_agree_with_two_threads():
    raw, _w = weights(T.Q4_K, 33, 256, seed=11)
    model = op_model("GgufMatMul", qtype=T.Q4_K, n=33, k=256, x_shape=["m", 256])
    x = np.random.default_rng(2).standard_normal((5, 256)).astype(np.float32)
    one = session(model, threads=1).run(None, {"x": x, "w": raw})[0]
    two = session(model).run(None, {"x": x, "w": raw})[0]
    assert np.array_equal(one, two)  # rows are split across threads, never a row's sum
    assert session(model).run(None, {"x": x[:0], "w": raw})[0].shape == (0, 33)



@pytest.mark.parametrize(("qtype", "row_group"), [(T.Q6_K, 0), (T.Q5_0, 0), (T.Q4_K, 0), (T.Q5_0, 8), (T.Q4_K, 8),
                                              (T.Q6_K, 8), (T.Q4_1, 8)],
                         ids=["Q6_K", "Q5_0", "Q4_K", "Q5_0-groups", "Q4_K-groups", "Q6_K-groups", "Q4_1-groups"])
def test_a_rows_result_does_not_depend_on_the_other_rows(qtype, row_group):
    """Each row of x is quantized and dotted on its own, in the same order whatever the tile it falls in: greedy
    answers do not depend on the batch, the chunk or speculation through these ops (Q4_K and Q6_K have a pass of
    their own for one row; a grouped matrix a dot of 8 weight rows at once)."""
    n = 24 if row_group else 20
    raw, _w = weights(qtype, n, 512, seed=5)
    raw = grouped(raw, qtype) if row_group else raw
    run = session(op_model("GgufMatMul", qtype=qtype, n=n, k=512, x_shape=["m", 512], row_group=row_group)).run
    x = np.random.default_rng(4).standard_normal((11, 512)).astype(np.float32)
    together = run(None, {"x": x, "w": raw})[0]
    for i in range(11):
        assert np.array_equal(run(None, {"x": x[i:i + 1], "w": raw})[0][0], together[i])


def test_a_family_that_needs_the_kernels_says_so_in_one_line_where_they_are_missing(monkeypatch, tmp_path):
    from staticlm.errors import UserError
    from staticlm.export.options import ExportRequest

    kernels.check_family(())  # a family without custom ops needs nothing
    monkeypatch.setattr(kernels, "LIBRARY", tmp_path / "missing.so")
    with pytest.raises(UserError, match="make kernels") as e:
        kernels.check_family((kernels.DOMAIN,))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="--gguf-kernels on: .*make kernels"):
        ExportRequest(target="cpu", gguf_kernels="on")
    assert ExportRequest(target="cpu").cpu_options().gguf_kernels is False  # MatMulNBits where they are missing


def test_a_library_older_than_its_sources_is_refused_in_one_line(monkeypatch, tmp_path):
    """A checkout updated without `make kernels` keeps the old library, which may not know the layouts the
    exporter now writes (it would compute wrong sums): running a family is refused until it is rebuilt."""
    from staticlm.errors import UserError

    library, source = tmp_path / "libstaticlm_gguf.so", tmp_path / "gguf_dot.c"
    library.write_bytes(kernels.TARGET_MARK + kernels.machine().encode() + b"::api17;")  # a library, for the loader
    source.write_text("")
    monkeypatch.setattr(kernels, "LIBRARY", library)
    os.utime(source, (1_000_000, 1_000_000))
    os.utime(library, (2_000_000, 2_000_000))
    kernels.check_family((kernels.DOMAIN,))  # built after its sources
    os.utime(source, (3_000_000, 3_000_000))
    with pytest.raises(UserError, match=r"older than their sources \(gguf_dot.c\): run `make kernels`") as e:
        kernels.check_family((kernels.DOMAIN,))
    assert "\n" not in str(e.value)
    kernels.check_family(())  # a family without the ops does not care
