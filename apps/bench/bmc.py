"""BMC's microbenchmark on this host: aBW, bC and C0, and the attention-block latency vs T (its Figure 8).

One layer's decode attention (the model's KV heads, query-head groups and head dim) runs in ONNX Runtime
with a symbolic past length, as in the CPU family's graphs. Measured:
- bC: attention multiply-accumulates per second: the slope of step time over the window length P;
- aBW: bytes per second of a BMC reallocation (a zeroed array, the valid rows copied in), as kv_manager does;
- C0: the one-off cost of a window length ORT has not run before (a new shape).
C' = (seconds of attention per row) / (seconds of copy per row) = aBW * MACs_row / (bC * bytes_row), which is
the paper's aBW / (2 bC) for its 4 bytes and 2 MACs per row element. The rates are saved (ladder.save_rates)
for the runtime's choice of r. Then, for each N, the BMC loop (a new array every r = N/T tokens) is timed
for every power of two T, and the model's choice is shown next to the measured optimum.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from staticlm.kv_manager.sizing import choose_bmc_r
from staticlm.runtime.engine.ladder import HostRates, save_rates
from staticlm.runtime.family.manifest import load_manifest

from .base import BenchContext, Row

FULL_SIZES = (256, 1024, 2048)
QUICK_SIZES = (32, 64)


@dataclass(frozen=True)
class AttentionShape:
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int

    @property
    def macs_per_row(self) -> int:  # q.K^T and p.V for every query head
        return 2 * self.num_kv_heads * self.group * self.head_dim

    @property
    def bytes_per_row(self) -> int:  # K and V rows, float32
        return 2 * self.num_kv_heads * self.head_dim * 4


def attention_session(shape: AttentionShape, *, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    h, g, d = shape.num_kv_heads, shape.group, shape.head_dim
    nodes = [  # the CPU family's formulation: K read with transB (no transposed copy), GQA by query groups
        helper.make_node("FusedMatMul", ["q", "k"], ["s"], domain="com.microsoft", transB=1, alpha=1 / math.sqrt(d)),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]
    graph = helper.make_graph(nodes, "attention", [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, h, g, d]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, h, "P", d]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, h, "P", d])],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1, h, g, d])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _slope(xs, ys) -> float:
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def _best_time(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_rates(session, shape: AttentionShape, *, sizes: tuple[int, ...], iters: int) -> HostRates:
    h, g, d = shape.num_kv_heads, shape.group, shape.head_dim
    q = np.random.default_rng(0).standard_normal((1, h, g, d), dtype=np.float32)
    lengths = sorted({max(8, n // 4) for n in sizes} | set(sizes) | {max(sizes) // 2})
    step_s, first_s = [], []
    for p in lengths:
        kv = np.random.default_rng(p).standard_normal((2, 1, h, p, d), dtype=np.float32)
        feeds = {"q": q, "k": kv[0], "v": kv[1]}
        t0 = time.perf_counter()
        session.run(None, feeds)  # the first run at this window length: C0 is its excess
        first_s.append(time.perf_counter() - t0)
        step_s.append(_best_time(lambda f=feeds: [session.run(None, f) for _ in range(iters)], 3) / iters)
    att_per_row = max(_slope(lengths, step_s), 1e-12)
    c0 = max(0.0, float(np.median(np.subtract(first_s, step_s))))
    copy_s = []
    src = np.ones((2, h, max(lengths), d), np.float32)
    for p in lengths:
        def realloc(p=p):
            new = np.zeros((2, h, p + 1, d), np.float32)  # kv_manager's BMC: a zeroed array, rows copied in
            new[:, :, :p] = src[:, :, :p]
        copy_s.append(_best_time(lambda: [realloc() for _ in range(iters)], 3) / iters)
    copy_per_row = max(_slope(lengths, copy_s), 1e-12)
    alpha_bw = shape.bytes_per_row / copy_per_row
    beta_c = shape.macs_per_row / att_per_row
    return HostRates(copy_bandwidth=alpha_bw, attention_rate=beta_c, c_prime=att_per_row / copy_per_row,
                     c0_seconds=c0)


def bmc_loop_seconds(session, shape: AttentionShape, *, n: int, t: int) -> float:
    """N decode steps of one layer's attention with a new array of r = N/T more rows every r tokens."""
    h, g, d = shape.num_kv_heads, shape.group, shape.head_dim
    r = n // t
    q = np.full((1, h, g, d), 0.01, np.float32)
    buf = np.zeros((2, 1, h, 0, d), np.float32)
    t0 = time.perf_counter()
    for step in range(n):
        if step % r == 0:
            new = np.zeros((2, 1, h, (step // r + 1) * r, d), np.float32)
            new[:, :, :, :step] = buf[:, :, :, :step]
            buf = new
        session.run(None, {"q": q, "k": buf[0], "v": buf[1]})
    return time.perf_counter() - t0


def model_choice_with_c0(rates: HostRates, shape: AttentionShape, n: int) -> int:
    """T from the paper's equation (6) with C0: T = sqrt(N * c_att / (c_copy + 2 C0 / N)), a power of two."""
    c_copy = shape.bytes_per_row / rates.copy_bandwidth
    c_att = shape.macs_per_row / rates.attention_rate
    t = math.sqrt(n * c_att / (c_copy + 2 * rates.c0_seconds / n))
    return min(n, 2 ** max(0, round(math.log2(max(t, 1.0)))))


def bench_bmc(ctx: BenchContext) -> list[Row]:
    cfg = load_manifest(ctx.model_dir).model
    shape = AttentionShape(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    quick = ctx.options.quick
    sizes = QUICK_SIZES if quick else FULL_SIZES
    session = attention_session(shape, threads=ctx.options.threads)
    rates = measure_rates(session, shape, sizes=sizes, iters=5 if quick else 50)
    path = save_rates(rates)  # the runtime's cache (STATICLM_CACHE moves it)
    ctx.log(f"  host rates: aBW {rates.copy_bandwidth / 1e9:.2f} GB/s, bC {rates.attention_rate / 1e9:.2f} GMAC/s, "
            f"C' {rates.c_prime:.3f}, C0 {rates.c0_seconds * 1e6:.0f} us -> {path}")
    rows: list[Row] = [
        Row("bmc.alpha_bw", "BMC aBW: KV row copy bandwidth", "GB/s", rates.copy_bandwidth / 1e9),
        Row("bmc.beta_c", "BMC bC: decode attention throughput", "GMAC/s", rates.attention_rate / 1e9),
        Row("bmc.c0", "BMC C0: first run at a new window length", "us", rates.c0_seconds * 1e6,
            higher_is_better=False)]
    figure: dict[str, dict] = {}
    choices = []
    for n in sizes:
        ts = [2 ** i for i in range(int(math.log2(n)) + 1)]
        bmc_loop_seconds(session, shape, n=n, t=n)  # untimed: ORT's first runs must not land on the first T
        # Best of 3: the machine may be shared, and a preempted loop says nothing about T.
        latency = {t: min(bmc_loop_seconds(session, shape, n=n, t=t) for _ in range(3)) for t in ts}
        best_t = min(latency, key=latency.get)
        r_model = choose_bmc_r(max_context=n, c_prime=rates.c_prime)
        t_model, t_c0 = n // r_model, model_choice_with_c0(rates, shape, n)
        figure[str(n)] = {"T": ts, "seconds": [latency[t] for t in ts], "model_T": t_model, "model_c0_T": t_c0,
                          "best_T": best_t}
        choices.append({"N": n, "model_r": r_model, "model_T": t_model, "model_c0_T": t_c0, "best_T": best_t,
                        "best_r": n // best_t})
        rows.append(Row(f"bmc.N{n}", f"BMC attention block, N={n}: model's T vs best", "ms", latency[t_model] * 1e3,
                        higher_is_better=False, note=(
                            f"model T={t_model} (r={r_model}; with C0: T={t_c0}); measured best T={best_t} "
                            f"{latency[best_t] * 1e3:.1f} ms; T=1 {latency[1] * 1e3:.1f} ms, "
                            f"T=N {latency[n] * 1e3:.1f} ms")))
    ctx.figures["bmc_attention"] = figure
    ctx.extra["host_rates"] = {**rates.to_dict(), "saved_to": str(path), "shape": shape.__dict__, "choices": choices}
    return rows
