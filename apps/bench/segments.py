"""Segment KV: n = 4 responses to one prompt, the prompt's K/V shared or copied into every row.

Per prompt length (100 and 1,000 tokens of the bench text), 64 sampled tokens per response:
(a) the wall time for all 4 answers together (segmented graphs, and the copy-based batch) against one after
    another with the prompt prefilled once and reused from the generator's prefix cache (the fastest of 3
    interleaved rounds each);
(b) the decode step cost at B = 4 over B = 1, segmented and copy-based, timed in interleaved rounds;
and the KV bytes each path holds (the segmented one is formula (3)).
"""
from __future__ import annotations

import time

import numpy as np

from staticlm.kv_manager.segments import copied_kv_rows, segment_kv_rows, token_bytes
from staticlm.runtime.engine.engine import Engine
from staticlm.runtime.engine.segment_engine import SegmentEngine
from staticlm.runtime.family.manifest import GraphKind, load_manifest
from staticlm.runtime.generate.drive import generate_many
from staticlm.runtime.generate.loop import GenerationLoop
from staticlm.runtime.generate.sampling import SamplingParams
from staticlm.runtime.generate.text_stream import GenerationParams

from .base import BenchContext, Row

NUM_RESPONSES = 4
PROMPT_LENS = (100, 1000)
NEW_TOKENS = 64
STEP_ROUNDS = 3  # interleaved rounds of the three step timings (the machine is shared: rounds cancel drift)
WALL_ROUNDS = 3  # interleaved rounds of the three ways to get the answers


def _timed_steps(step, num_steps: int) -> float:
    """Median seconds of one step over num_steps calls."""
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _step_costs(single: Engine, segmented: SegmentEngine, copied: Engine, ids: list[int], *,
                num_steps: int) -> dict[str, float]:
    """Median decode step of each path from the same prefilled prompt, in interleaved rounds."""
    token = np.full(NUM_RESPONSES, ids[-1], np.int64)  # [B]
    active = np.ones(NUM_RESPONSES, bool)  # [B]
    out: dict[str, list[float]] = {"b1": [], "segment": [], "copy": []}
    for _ in range(STEP_ROUNDS):
        single.reset()
        single.prefill(ids)
        segmented.load_prefix(single)
        out["segment"].append(_timed_steps(lambda: segmented.decode_batch(token, active=active), num_steps))
        copied.load_prefix(single)
        out["copy"].append(_timed_steps(lambda: copied.decode_batch(token, active=active), num_steps))
        out["b1"].append(_timed_steps(lambda: single.decode(int(ids[-1])), num_steps))  # last: it moves the prompt
    return {k: float(np.median(v)) for k, v in out.items()}


def _walls(model, segmented: GenerationLoop, copied: GenerationLoop, ids: list[int], params, *,
           rounds: int) -> dict[str, float]:
    """Seconds to get all the answers: together (segmented, copy-based) and one after another with the prompt
    prefilled once and reused (the generator's prefix cache); interleaved rounds, the fastest of each (noise only
    adds)."""
    def sequential():
        model.generator.reset()
        for _ in range(NUM_RESPONSES):  # later runs rewind to the cached prompt (sync_prefix)
            model.generate(ids, params)

    runs = {"segment": lambda: generate_many(segmented, ids, params, num_responses=NUM_RESPONSES),
            "copy": lambda: generate_many(copied, ids, params, num_responses=NUM_RESPONSES), "sequential": sequential}
    walls = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            walls[name] = min(walls[name], time.perf_counter() - t0)
    return walls


def bench_segments(ctx: BenchContext) -> list[Row]:
    manifest = load_manifest(ctx.model_dir)
    if not manifest.graphs_of(GraphKind.SEGMENT, batch=NUM_RESPONSES):
        ctx.extra.setdefault("skipped_rows", {})["segments"] = (f"the family has no segmented batch-{NUM_RESPONSES} "
                                                                "graphs (re-export it with this version)")
        return []
    model = ctx.model()
    new_tokens = 8 if ctx.options.quick else NEW_TOKENS
    params = GenerationParams(max_new_tokens=new_tokens, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))
    segmented = GenerationLoop(model.loop_parts(), rows="segments", eager=True)
    copied = GenerationLoop(model.loop_parts(), rows="copies", eager=True)
    rows, raw = [], {}
    for prompt_len in PROMPT_LENS:
        if prompt_len + new_tokens + 1 > ctx.max_context or prompt_len > len(ctx.text_ids):
            ctx.extra.setdefault("skipped_rows", {})[f"segments@{prompt_len}"] = "the prompt does not fit"
            continue
        ids = list(ctx.text_ids[:prompt_len])
        ctx.log(f"  segments: {NUM_RESPONSES} responses to a {prompt_len}-token prompt ...")
        walls = _walls(model, segmented, copied, ids, params,
                       rounds=1 if ctx.options.quick else WALL_ROUNDS)
        gen = model.generator
        seg_engine, copy_engine = segmented.rows.engine, copied.rows.engine
        kv_segment = seg_engine.segments.kv_bytes
        kv_copy_valid = int(copy_engine.kv.lengths.sum()) * token_bytes(copy_engine.kv.spec)
        kv_copy_reserved = copy_engine.kv.stats.reserved_bytes
        steps = _step_costs(model.engine, seg_engine, copy_engine, ids, num_steps=8 if ctx.options.quick else 32)
        gen.reset()
        cached = new_tokens - 1  # a response's last token is sampled, never fed back: it has no KV row
        formula = segment_kv_rows(num_prompt=prompt_len, num_responses=NUM_RESPONSES, response_len=cached)
        standard = copied_kv_rows(num_prompt=prompt_len, num_responses=NUM_RESPONSES, response_len=cached)
        raw[prompt_len] = {"wall_s": walls, "step_s": steps, "kv_bytes": {
            "segment": kv_segment, "copy_valid": kv_copy_valid, "copy_reserved": kv_copy_reserved,
            "formula_3_rows": formula, "copy_rows": standard}}
        key = f"segments.p{prompt_len}"
        rows += [
            Row(f"{key}.together", f"{NUM_RESPONSES} answers together (segment KV), prompt {prompt_len}", "s",
                walls["segment"], higher_is_better=False,
                note=f"{walls['sequential'] / walls['segment']:.2f}x one after another "
                     f"({walls['sequential']:.2f} s); copy-based together {walls['copy']:.2f} s "
                     f"({walls['sequential'] / walls['copy']:.2f}x)"),
            Row(f"{key}.step_ratio_segment", f"B={NUM_RESPONSES} step / B=1 step, segment KV, prompt {prompt_len}",
                "x", steps["segment"] / steps["b1"], higher_is_better=False,
                note=f"{steps['segment'] * 1e3:.1f} ms vs {steps['b1'] * 1e3:.1f} ms; "
                     f"segmented / copy-based step {steps['segment'] / steps['copy']:.2f}x"),
            Row(f"{key}.step_ratio_copy", f"B={NUM_RESPONSES} step / B=1 step, copy-based, prompt {prompt_len}",
                "x", steps["copy"] / steps["b1"], higher_is_better=False, note=f"{steps['copy'] * 1e3:.1f} ms"),
            Row(f"{key}.kv_segment", f"KV bytes, segment KV, prompt {prompt_len}", "MB", kv_segment / 1e6,
                higher_is_better=False,
                note=f"formula (3): {formula} rows; copy-based {kv_copy_valid / 1e6:.1f} MB valid ({standard} rows), "
                     f"{kv_copy_reserved / 1e6:.1f} MB reserved"),
        ]
    ctx.extra["segments"] = raw
    return rows
