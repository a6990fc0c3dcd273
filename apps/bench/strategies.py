"""Per-token latency vs position over one long generation, for each KV strategy (BMC's Figure 16).

The same greedy token stream (teacher-forced from the text, so every strategy does identical work) is
decoded with concat (a new array every token), shift (the window copied left every token), bmc (a new
array every r tokens; r from this host's measured rates) and pointer (ours: one memmove per S-1 tokens),
all on per-head window graphs; and, for a family of in-place graphs (the cpu target's default), in_place
(GroupQueryAttention appends to the buffer itself). The window rows then come from --windows-model.
"""
from __future__ import annotations

import time

import numpy as np

from staticlm.kv_manager import Strategy
from staticlm.runtime.engine.ladder import ladder_step, load_rates
from staticlm.runtime.family.contract import KVLayout
from staticlm.runtime.family.manifest import load_manifest

from .base import BenchContext, BenchError, Row

ORDER = (Strategy.CONCAT, Strategy.SHIFT, Strategy.BMC, Strategy.POINTER)
PROMPT_TOKENS = 16


def generation_length(ctx: BenchContext) -> int:
    if ctx.options.long_gen is not None:
        return min(ctx.options.long_gen, ctx.max_context - PROMPT_TOKENS - 1)
    cap = 48 if ctx.options.quick else 1024
    return min(cap, ctx.max_context) - PROMPT_TOKENS - 1


def _bmc_r(ctx: BenchContext) -> int:
    return ladder_step(max_context=ctx.max_context, rates=load_rates())


def latencies(ctx: BenchContext, strategy: Strategy, tokens: list[int], *, model_dir) -> tuple[np.ndarray, dict]:
    """Seconds per decode step at positions PROMPT_TOKENS.. and the cache's counters."""
    bmc_r = _bmc_r(ctx) if strategy is Strategy.BMC else None
    engine = ctx.model(model_dir=model_dir, kv_strategy=strategy, bmc_r=bmc_r).engine
    engine.prefill(tokens[:PROMPT_TOKENS])
    before = engine.kv.stats.copied_bytes  # the prefill's own copies are not the per-token cost
    seconds = np.empty(len(tokens) - PROMPT_TOKENS)
    for i, token in enumerate(tokens[PROMPT_TOKENS:]):
        t0 = time.perf_counter()
        engine.decode(token)
        seconds[i] = time.perf_counter() - t0
    stats = engine.kv.stats
    return seconds, {"copied_bytes": stats.copied_bytes - before, "allocations": stats.num_allocations,
                     "compactions": stats.num_compactions, "reserved_bytes": stats.reserved_bytes,
                     "bmc_r": bmc_r}


def _runs(ctx: BenchContext) -> list[tuple[Strategy, object]]:
    """(strategy, family) pairs: the window strategies on a per-head family, in_place on an in-place one."""
    if load_manifest(ctx.model_dir).kv_layout is KVLayout.PER_HEAD:
        return [(s, ctx.model_dir) for s in ORDER]
    windows = ctx.options.windows_model
    if windows is None:
        ctx.extra.setdefault("skipped_rows", {})["strategy (concat, shift, bmc, pointer)"] = (
            f"{ctx.model_dir} keeps its KV in place; pass --windows-model DIR, an export of the same model with "
            "`staticlm export --target cpu --cpu-attention windows --out DIR`")
        return [(Strategy.IN_PLACE, ctx.model_dir)]
    if load_manifest(windows).kv_layout is not KVLayout.PER_HEAD:
        raise BenchError(f"--windows-model {windows} keeps its KV in place too: export it with --cpu-attention windows")
    return [(s, windows) for s in ORDER] + [(Strategy.IN_PLACE, ctx.model_dir)]


def bench_strategies(ctx: BenchContext) -> list[Row]:
    n = generation_length(ctx)
    tokens = ctx.text_ids[:PROMPT_TOKENS + n]
    figure: dict[str, dict] = {}
    means: dict[Strategy, float] = {}
    rows = []
    runs = _runs(ctx)
    for strategy, model_dir in runs:
        ctx.log(f"  {strategy.value}: {n} tokens ...")
        seconds, stats = latencies(ctx, strategy, tokens, model_dir=model_dir)
        ms = seconds * 1e3
        figure[strategy.value] = {"position": list(range(PROMPT_TOKENS, PROMPT_TOKENS + n)),
                                  "ms": [round(float(v), 4) for v in ms], **stats}
        means[strategy] = float(ms.mean())
        extra = f", r={stats['bmc_r']}" if stats["bmc_r"] else ""
        rows.append(Row(f"strategy.{strategy.value}", f"per-token latency, {strategy.value} KV (mean of {n})", "ms",
                        means[strategy], higher_is_better=False, note=(
                            f"p95 {np.percentile(ms, 95):.1f} ms, max {ms.max():.1f} ms; KV copied "
                            f"{stats['copied_bytes'] / n / 1e3:.1f} kB/token, {stats['allocations']} allocations"
                            f"{extra}")))
    if Strategy.CONCAT in means:
        for row, (strategy, _) in zip(rows, runs):
            row.note += f"; {means[Strategy.CONCAT] / means[strategy]:.2f}x concat's speed"
    ctx.figures["strategy_latency"] = figure
    return rows
