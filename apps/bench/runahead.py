"""KV-Runahead on this host: TTFT of 2 workers x 1 thread against 1 worker x 2 threads, the searched
partition against an even split, and the workers' chain model (partition.modeled_ttft) projected to 4 and 8
workers from measured per-chunk costs.

The family: the bench's model when it keeps its KV in place, has layer-group parts and holds the longest prompt;
else the default model's cpu family exported once with --parts into the staticlm cache. The searched 2-worker
partition of each prompt length (binary search on measured TTFT) and the model's grid-searched 3, 4 and 8-worker
ones go into the partition table beside the BMC host measurements (runtime/engine/partition.py), which
`--prefill-workers N` interpolates.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from staticlm.apps.exporting import run_export
from staticlm.apps.home import DEFAULT_MODEL
from staticlm.runtime.engine.engine import Engine, EngineOptions
from staticlm.runtime.engine.ladder import cache_path
from staticlm.runtime.engine.partition import (
    PartitionTable,
    binary_search_split,
    even_sizes,
    grid_search,
    modeled_ttft,
)
from staticlm.runtime.engine.parts import part_layers
from staticlm.runtime.engine.runahead import RowSync
from staticlm.runtime.family.contract import KVLayout
from staticlm.runtime.family.manifest import load_manifest
from staticlm.runtime.session.device import Device, DeviceOptions

from .base import BenchContext, Row

LENGTHS, QUICK_LENGTHS = (1000, 2000, 4000), (256, 512)
NUM_PARTS = 10  # layer groups: finer groups let a later worker start sooner, each costs a sync and ORT runs
PROJECTED_WORKERS = (1, 2, 4, 8)
TABLE_WORKERS = (3, 4, 8)  # from the model's search (2 workers: measured)


def runahead_family(ctx: BenchContext, longest: int) -> Path | None:
    """The family to run (None with --quick: no multi-minute export for a smoke run)."""
    manifest = load_manifest(ctx.model_dir)
    decode = [g for g in manifest.graphs if g.kind.value == "decode" and g.shape.batch == 1]
    if (manifest.kv_layout is KVLayout.IN_PLACE and part_layers(manifest)
            and decode and decode[-1].shape.past_len >= longest):
        return ctx.model_dir
    if ctx.options.quick:
        return None
    context = -(-(longest + 64) // 64) * 64 + 64  # the prompt, room for answers, whole 64-row chunks
    out = cache_path().parent / f"runahead-{DEFAULT_MODEL}-cpu-c{context}-parts{NUM_PARTS}"
    if not (out / "manifest.json").is_file():
        ctx.log(f"  exporting {DEFAULT_MODEL} --target cpu --context {context} --parts {NUM_PARTS} to {out}")
        run_export(model=DEFAULT_MODEL, out_dir=out, target="cpu", contexts=(context,), verify_lens="none",
                   batch_sizes="none", parts=NUM_PARTS, quiet=True)
    return out


class TimingSync(RowSync):
    """Records how long each run of each group took, and after how many cached rows."""

    runs: list[tuple[int, int, float]] = []  # (group, rows before the sub-chunk, seconds)

    def reading(self, worker, group, *, rows):
        self._t0 = (rows, time.perf_counter())

    def wrote(self, worker, group, *, start, end):
        rows, t0 = self._t0
        self.runs.append((group, rows, time.perf_counter() - t0))


def fit_group_costs(runs: list[tuple[int, int, float]], *, num_groups: int, ar: int):
    """Per group g: a sub-chunk of AR rows after s cached rows costs a_g + b_g s (attention grows with s);
    group_seconds(g, c, s) sums that over a chunk's sub-chunks."""
    coef = []
    for g in range(num_groups):
        s, t = zip(*[(rows, sec) for gg, rows, sec in runs if gg == g], strict=True)
        b, a = np.polyfit(np.asarray(s, float), np.asarray(t, float), 1)
        coef.append((float(a), max(float(b), 0.0)))

    def group_seconds(g: int, c: int, s: int) -> float:
        a, b = coef[g]
        k = math.ceil(c / ar)
        return k * a + b * (k * s + ar * k * (k - 1) / 2)

    return group_seconds, coef


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_runahead(ctx: BenchContext) -> list[Row]:
    quick, threads = ctx.options.quick, ctx.options.threads
    lengths = QUICK_LENGTHS if quick else LENGTHS
    repeats = 1 if quick else 2
    family = runahead_family(ctx, max(lengths))
    if family is None:
        ctx.extra.setdefault("skipped_rows", {})["runahead"] = (
            f"the family is not an in-place one with --parts holding {max(lengths)} tokens (export --target cpu "
            f"--parts {NUM_PARTS}); without --quick the default model's is exported")
        return []
    cpu = DeviceOptions(device=Device.CPU, num_threads=threads)
    whole = Engine(family, options=EngineOptions(device=cpu))  # 1 worker x `threads` threads
    parallel = Engine(family, options=EngineOptions(device=cpu, prefill_workers=2))  # 2 workers x threads/2
    single = Engine(family, options=EngineOptions(device=dataclasses.replace(cpu, num_threads=1)))
    timing = single.parallel_prefill(1)  # 1 worker x 1 thread, through the parts: the per-chunk costs
    ra, ar, num_groups = parallel.runahead, parallel.runahead.ar, len(parallel.runahead.parts)
    vocab = whole.config.vocab_size
    text = np.asarray(ctx.text_ids * (max(lengths) // max(1, len(ctx.text_ids)) + 1), np.int64) % vocab

    def run_whole(ids):
        whole.reset()
        whole.prefill(ids)

    def run_parallel(ids, sizes):
        parallel.reset()
        ra.prefill(ids, sizes=sizes)

    for fn in (lambda: run_whole(text[:2 * ar]), lambda: run_parallel(text[:2 * ar], [ar, ar])):
        fn()  # untimed: sessions open and ORT's first runs
    fastest: dict[tuple[int, int], float] = {}  # (group, rows before) -> the best of the repeats (noise only adds)
    for _ in range(repeats):
        single.reset()
        TimingSync.runs = []
        timing.prefill(text[:max(lengths)], sync_class=TimingSync)
        for g, r, sec in TimingSync.runs:
            fastest[g, r] = min(fastest.get((g, r), math.inf), sec)
    group_seconds, coef = fit_group_costs([(g, r, sec) for (g, r), sec in fastest.items()], num_groups=num_groups,
                                          ar=ar)
    ctx.log(f"  per-chunk costs over {len(TimingSync.runs)} runs, 1 thread: {ar}-row sub-chunk "
            f"{sum(a for a, _b in coef) * 1e3:.1f} ms + {sum(b for _a, b in coef) * 1e9:.0f} ns per cached row")
    table = PartitionTable.load()
    rows, figure = [], {}
    for n in lengths:
        ids = text[:n]

        def measured(sizes, ids=ids):
            return min(_timed(lambda: run_parallel(ids, sizes)) for _ in range(repeats))

        searched = binary_search_split(measured, n, align=ar)
        even = even_sizes(n, 2, align=ar)
        runs = {"1w2t": lambda ids=ids: run_whole(ids), "2w1t": lambda ids=ids, s=searched: run_parallel(ids, s),
                "2w1t_even": lambda ids=ids, s=even: run_parallel(ids, s)}
        best = dict.fromkeys(runs, math.inf)
        for _ in range(repeats + 1):  # interleaved: the machine's noise lands on all three alike
            for key, fn in runs.items():
                best[key] = min(best[key], _timed(fn))

        def model(sizes):
            return modeled_ttft(sizes, group_seconds=group_seconds, num_groups=num_groups)

        projected, projected_even, partitions = [], [], {}
        for p in sorted(p for p in {*PROJECTED_WORKERS, *TABLE_WORKERS} if n >= p * ar):  # a whole chunk each
            sizes = binary_search_split(model, n, align=ar) if p == 2 else grid_search(model, n, p, align=ar)
            partitions[p] = sizes
            if p in PROJECTED_WORKERS:
                projected.append(model(sizes))
                projected_even.append(model(even_sizes(n, p, align=ar)))
        # A noisy machine can mislead the search: the table keeps it only if it also beat the even split when both
        # ran interleaved.
        table.add(n, searched if best["2w1t"] <= best["2w1t_even"] else even)
        for p in TABLE_WORKERS:
            if p in partitions:
                table.add(n, partitions[p])
        workers = [p for p in PROJECTED_WORKERS if p in partitions]
        model_serial = model([n])
        figure[str(n)] = {"workers": workers, "model_s": projected, "model_even_s": projected_even,
                          # the longest prompt's runs over its first n rows: a 1-thread prefill of n tokens
                          "measured_s": {**best, "1w1t": sum(sec for (_g, r), sec in fastest.items() if r < n)},
                          "searched": searched, "model_partitions": {str(k): v for k, v in partitions.items()}}
        ms = {k: v * 1e3 for k, v in best.items()}
        ctx.log(f"  {n} tokens: 2w x 1t {ms['2w1t']:.0f} ms (split {searched}), even {ms['2w1t_even']:.0f} ms, "
                f"1w x 2t {ms['1w2t']:.0f} ms; model 4w {projected[workers.index(4)] * 1e3:.0f} ms"
                if 4 in workers else f"  {n} tokens: 2w x 1t {ms['2w1t']:.0f} ms, 1w x 2t {ms['1w2t']:.0f} ms")
        rows += [
            Row(f"runahead.ttft@{n}.2w1t", f"TTFT {n}-token prompt, 2 workers x 1 thread (searched split)", "ms",
                ms["2w1t"], higher_is_better=False,
                note=f"1 worker x 2 threads {ms['1w2t']:.0f} ms ({best['1w2t'] / best['2w1t']:.2f}x); split "
                     f"{searched}; even split {even} {ms['2w1t_even']:.0f} ms; 1 worker x 1 thread (parts) "
                     f"{figure[str(n)]['measured_s']['1w1t'] * 1e3:.0f} ms"),
            Row(f"runahead.ttft@{n}.1w2t", f"TTFT {n}-token prompt, 1 worker x 2 threads (whole graphs)", "ms",
                ms["1w2t"], higher_is_better=False),
            Row(f"runahead.ttft@{n}.even", f"TTFT {n}-token prompt, 2 workers x 1 thread, even split", "ms",
                ms["2w1t_even"], higher_is_better=False),
            *(Row(f"runahead.model@{n}.{p}w", f"TTFT {n}-token prompt, chain model, {p} workers (1 core each)",
                  "ms", projected[workers.index(p)] * 1e3, higher_is_better=False,
                  note=f"partition {partitions[p]}; even split {projected_even[workers.index(p)] * 1e3:.0f} ms; "
                       f"model at 1 worker x 1 thread {model_serial * 1e3:.0f} ms, at 2 workers "
                       f"{projected[workers.index(2)] * 1e3:.0f} ms") for p in (4, 8) if p in workers)]
    path = table.save()
    ctx.log(f"  partition table -> {path}")
    ctx.figures["runahead"] = figure
    ctx.extra["runahead"] = {"family": str(family), "parts": num_groups, "prompt_graph_rows": ar,
                             "group_costs": coef, "table": str(path)}
    return rows


def plot_runahead(figure: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figure), figsize=(4.2 * len(figure), 4), squeeze=False)
    for ax, (n, data) in zip(axes[0], figure.items(), strict=True):
        ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
        ax.plot(data["workers"], ms(data["model_s"]), marker="o", label="model, searched split")
        ax.plot(data["workers"], ms(data["model_even_s"]), marker="o", linestyle="--", label="model, even split")
        m = data["measured_s"]
        ax.scatter([2], [m["2w1t"] * 1e3], color="tab:red", zorder=3, label="measured 2w x 1t, searched")
        ax.scatter([2], [m["2w1t_even"] * 1e3], color="tab:orange", zorder=3, label="measured 2w x 1t, even")
        ax.scatter([1], [m["1w2t"] * 1e3], color="tab:green", marker="s", zorder=3, label="measured 1w x 2t")
        ax.scatter([1], [m["1w1t"] * 1e3], color="tab:gray", marker="s", zorder=3,
                   label="measured 1w x 1t (parts)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["workers"], [str(w) for w in data["workers"]])
        ax.set_xlabel("prefill workers (1 thread each)")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{n}-token prompt")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("KV-Runahead TTFT: measured points and the chain model from measured per-chunk costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
