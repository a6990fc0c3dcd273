"""Speculative decoding (none, prompt lookup with BASS's dynamic or a fixed draft length)
on input-grounded rewrites and on open chat; and n = 4 responses decoded together vs one after another.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from staticlm.runtime.engine.steps import StepCounters
from staticlm.runtime.family.manifest import GraphKind, load_manifest
from staticlm.runtime.generate.sampling import SamplingParams
from staticlm.runtime.generate.text_stream import GenerationParams
from staticlm.runtime.model import Model
from staticlm.runtime.text.chat_template import Message
from staticlm.runtime.text.tokenizer import Tokenizer

from .base import BenchContext, Row

FIXED_DRAFT = 7  # BASS's l0: the fixed length the dynamic one starts from
CHAT_PROMPT = "Give me some advice on learning to cook at home."
BATCH_PROMPT = "Write a short poem about the sea."
NUM_RESPONSES = 4
REWRITE_PASSAGES = 4
PASSAGE_SPACING = 500  # tokens: four passages inside the shipped text (~2,300 tokens), none repeated


@dataclass(frozen=True)
class SpecConfig:
    name: str
    speculate: str  # the run options --speculate and --draft-len
    draft_len: int | None = None


CONFIGS = (SpecConfig("none", "none"), SpecConfig("lookup", "lookup"),
           SpecConfig(f"lookup, fixed {FIXED_DRAFT}", "lookup", FIXED_DRAFT))


def _chat_ids(model: Model, text: str) -> tuple[list[int], Tokenizer]:
    return model.format.prompt_ids([Message(role="user", content=text)]), model.tokenizer


def _rewrite_prompt(passage: str) -> str:
    return f"Rewrite the following text exactly as it is.\n\n{passage}"


def _rewrite_tasks(ctx: BenchContext, model: Model, max_new: int) -> list[list[int]]:
    """REWRITE_PASSAGES passages spread over the shipped text, budget tokens each, as chat prompts. How well a
    small model copies swings from passage to passage, so one passage would measure the passage; the figure is
    over all of them."""
    text = ctx.text_ids
    budget = 200  # passage tokens; the answer repeats them, so halve until prompt and answer fit
    while True:
        offsets = [i * PASSAGE_SPACING for i in range(REWRITE_PASSAGES) if i * PASSAGE_SPACING + budget <= len(text)]
        tasks = [_chat_ids(model, _rewrite_prompt(model.tokenizer.decode(text[o:o + budget])))[0]
                 for o in offsets or [0]]
        if max(map(len, tasks)) + max_new <= ctx.max_context or budget <= 8:
            return tasks
        budget //= 2


def _run(model: Model, ids: list[int], config: SpecConfig, max_new: int) -> dict:
    engine = model.engine
    engine.reset()
    engine.counters = StepCounters()  # per configuration: speculation's cost estimate starts afresh too
    run = Model(engine, options=model.options.replace(speculate=config.speculate, draft_len=config.draft_len))
    gen = run.generator
    result = run.generate(ids, GenerationParams(max_new_tokens=max_new))
    c, stats = engine.counters, gen.speculator.stats if gen.speculator else None
    decode_tokens = max(len(result.token_ids) - 1, 0)  # the first token comes from the prefill
    return {"tok_s": result.decode_tok_s, "tokens": len(result.token_ids), "text": result.text[:200],
            "decode_s": decode_tokens / result.decode_tok_s if result.decode_tok_s else 0.0,
            "decode_tokens": decode_tokens,
            "drafted": stats.num_drafted if stats else 0, "accepted": stats.num_accepted if stats else 0,
            "steps": stats.num_steps if stats else 0,
            "verify_tokens": c.num_verify_tokens, "verify_rows": c.num_verify_rows}


def _pooled(runs: list[dict]) -> dict:
    """Several prompts' runs as one: tokens over time, acceptance over all drafts."""
    total = {k: sum(r[k] for r in runs) for k in ("decode_s", "decode_tokens", "tokens", "drafted", "accepted",
                                                 "steps", "verify_tokens", "verify_rows")}
    return {**total, "tok_s": total["decode_tokens"] / total["decode_s"] if total["decode_s"] else 0.0,
            "acceptance": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
            "accepted_per_step": total["accepted"] / total["steps"] if total["steps"] else 0.0,
            "verify_row_use": total["verify_tokens"] / total["verify_rows"] if total["verify_rows"] else 0.0,
            "per_prompt_tok_s": [r["tok_s"] for r in runs], "texts": [r["text"] for r in runs]}


def bench_speculative(ctx: BenchContext) -> list[Row]:
    model = ctx.model()
    if not model.engine.verify_lens:
        ctx.extra.setdefault("skipped_rows", {})["speculative"] = "the family has no AR=N (verify) graphs"
        return []
    max_new = 12 if ctx.options.quick else 128
    chat_ids, _ = _chat_ids(model, CHAT_PROMPT)
    rewrites = _rewrite_tasks(ctx, model, max_new)
    if max(*map(len, rewrites), len(chat_ids)) + max_new > ctx.max_context:
        ctx.extra.setdefault("skipped_rows", {})["speculative"] = "the prompts do not fit the model's context"
        return []
    rows, raw = [], {}
    for config in CONFIGS:  # untimed: every graph and rung these runs touch is loaded and run once first
        _run(model, rewrites[0], config, 4)
    for task, prompts in (("rewrite", rewrites), ("chat", [chat_ids])):
        base = None
        for config in CONFIGS:
            ctx.log(f"  {task}, speculate {config.name} ...")
            r = _pooled([_run(model, ids, config, max_new) for ids in prompts])
            raw[f"{task}/{config.name}"] = r
            base = base or r
            per_prompt = ", ".join(f"{a / b:.2f}x" for a, b in zip(r["per_prompt_tok_s"], base["per_prompt_tok_s"]))
            note = (f"{r['tok_s'] / base['tok_s']:.2f}x vs none" + (f" (by prompt {per_prompt})" if len(prompts) > 1
                                                                      else "")
                    + f"; acceptance {r['acceptance']:.2f}, {r['accepted_per_step']:.2f} accepted/step, "
                    f"verify rows used {100 * r['verify_row_use']:.0f} %"
                    if config.speculate != "none" else f"{r['tokens']} tokens, {len(prompts)} prompt(s)")
            rows.append(Row(f"spec.{task}.{config.name.replace(', ', '_').replace(' ', '')}",
                            f"decode tok/s, {task}, speculate {config.name}", "tok/s", r["tok_s"], note=note))
    ctx.extra["speculative"] = raw
    return rows


def bench_responses(ctx: BenchContext) -> list[Row]:
    if not load_manifest(ctx.model_dir).graphs_of(GraphKind.DECODE, batch=NUM_RESPONSES):
        ctx.extra.setdefault("skipped_rows", {})["responses"] = f"the family has no batch-{NUM_RESPONSES} graphs"
        return []
    model = ctx.model()
    ids, _ = _chat_ids(model, BATCH_PROMPT)
    max_new = 8 if ctx.options.quick else 64
    if len(ids) + max_new > ctx.max_context:
        ctx.extra.setdefault("skipped_rows", {})["responses"] = "the prompt does not fit the model's context"
        return []
    # Equal work for both: sampled (so the answers differ), never stopping early.
    params = GenerationParams(max_new_tokens=max_new, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))
    model.loop.rows.open()  # before the clock starts
    ctx.log(f"  {NUM_RESPONSES} responses together ...")
    t0 = time.perf_counter()
    responses = model.generate_many(ids, params, num_responses=NUM_RESPONSES)
    together = time.perf_counter() - t0
    total = sum(len(r.token_ids) for r in responses)
    ctx.log(f"  {NUM_RESPONSES} responses one after another ...")
    t0 = time.perf_counter()
    seq_tokens, first_seq = 0, 0.0
    for _ in range(NUM_RESPONSES):
        model.generator.reset()
        seq_tokens += len(model.generate(ids, params).token_ids)
        first_seq = first_seq or time.perf_counter() - t0
    sequential = time.perf_counter() - t0
    first = min(r.last_token_s for r in responses)
    ctx.extra["responses"] = {"together_s": together, "sequential_s": sequential, "first_response_s": first,
                              "first_sequential_s": first_seq}
    return [Row(f"responses{NUM_RESPONSES}.together", f"{NUM_RESPONSES} responses decoded together, total tok/s",
                "tok/s", total / together, note=(
                    f"{total / together / (seq_tokens / sequential):.2f}x one after another; first response "
                    f"done {first:.2f} s (sequential: {first_seq:.2f} s)")),
            Row(f"responses{NUM_RESPONSES}.sequential", f"{NUM_RESPONSES} responses one after another, total tok/s",
                "tok/s", seq_tokens / sequential)]
