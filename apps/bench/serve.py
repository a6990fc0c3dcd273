"""`staticlm serve` under load (serve_load.py: 1, 4 and 8 streaming clients, some with ~1,000-token prompts,
against one client's prefill of such a prompt), and a conversation's TTFT with the prompt cache on and off.

The server runs in its own process (serve_process.py: `staticlm serve` on a free loopback port, the bench's
thread count); the clients are threads here, each streaming one chat completion of a fixed number of tokens
(ignore_eos, so every request asks for the same work) with logprobs on, which tells how many tokens each SSE
chunk carries.
"""
from __future__ import annotations

import logging

import numpy as np

from .base import BenchContext, Row
from .memory import budget_note, mappings_note, model_file_bytes
from .serve_load import (
    CLIENTS,
    NUM_TOKENS,
    TTFT_TARGET,
    Prompts,
    fitted_long_words,
    long_prefill,
    passages,
    run_clients,
)
from .serve_process import running_server, stream_chat
from .worker import PeakMemory

NUM_TURNS = 10
TURN_TOKENS = 32
QUICK_LONG_WORDS = 60  # a smoke run's "long" prompt (its model's context may be small)


def _metric(base: str, name: str) -> float:
    """One gauge from the server's /metrics (0 when it is not there)."""
    import httpx

    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _conversation(base: str, turns: list[str], *, max_tokens: int) -> list[dict]:
    """Turn after turn with the whole history, until the turns run out or the history fills the context (a model
    that answers in long runs of rare tokens does, with random weights)."""
    import httpx

    history, out = [], []
    for text in turns:
        history.append({"role": "user", "content": text})
        try:
            r = stream_chat(base, history, max_tokens=max_tokens)
        except httpx.HTTPStatusError as e:
            if e.response.status_code == 400:  # context_length_exceeded
                break
            raise
        history.append({"role": "assistant", "content": r["text"]})
        out.append({"ttft_s": r["ttft_s"], "cached": r["cached"]})
    return out


def bench_serve(ctx: BenchContext) -> list[Row]:
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
    except ImportError as e:
        ctx.extra.setdefault("skipped_rows", {})["serve"] = f"the serve extra is not installed ({e.name})"
        return []
    quick = ctx.options.quick
    max_tokens = 8 if quick else NUM_TOKENS
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    with running_server(ctx.model_dir, threads=ctx.options.threads, processes=(server := [])) as base:
        stream_chat(base, [{"role": "user", "content": "warm up"}], max_tokens=4)
        long_words = QUICK_LONG_WORDS if quick else fitted_long_words(_token_counter(ctx.model_dir))
        rows = _load_rows(ctx, base, server[0].pid, clients=(1, 2) if quick else CLIENTS, max_tokens=max_tokens,
                          prompts=Prompts(long_words=long_words))
        turns = passages(3, num_words=5) if quick else passages(NUM_TURNS)
        ctx.log(f"  a {len(turns)}-turn conversation, prompt cache on ...")
        cache_on = _conversation(base, turns, max_tokens=max_tokens if quick else TURN_TOKENS)
    with running_server(ctx.model_dir, "--no-prompt-cache", threads=ctx.options.threads) as base:
        ctx.log("  the same conversation, prompt cache off ...")
        stream_chat(base, [{"role": "user", "content": "warm up"}], max_tokens=4)
        cache_off = _conversation(base, turns, max_tokens=max_tokens if quick else TURN_TOKENS)
    return rows + _conversation_rows(ctx, cache_on, cache_off)


def _token_counter(model_dir):
    """text -> the family's own token count."""
    from staticlm.runtime.model import open_tokenizer

    tokenizer = open_tokenizer(model_dir)
    return lambda text: len(tokenizer.encode(text))


def _load_rows(ctx: BenchContext, base: str, pid: int, *, clients: tuple[int, ...], max_tokens: int,
               prompts: Prompts) -> list[Row]:
    """One client's long prefill, then each client count's run; their rows, raw figures in ctx.extra["serve"]."""
    ctx.log("  one client's long prompt, alone ...")
    prefill = long_prefill(base, prompts=prompts)
    rows, raw = [Row("serve.long_prefill.ttft_p50", "serve, 1 client: TTFT p50 of a long prompt", "ms",
                     1000 * prefill["ttft_p50_s"], higher_is_better=False,
                     note=f"{prefill['prompt_tokens']} prompt tokens, {prefill['cached_tokens']} cached")], {}
    for c in clients:
        ctx.log(f"  {c} concurrent streaming client(s) x {max_tokens} tokens ...")
        with PeakMemory(pid, mappings=True) as memory:
            raw[c] = r = run_clients(base, c, max_tokens=max_tokens, prompts=prompts)
        r["peak_pss_bytes"], r["peak_rss_bytes"] = memory.peak_pss, memory.peak_rss
        r["kv_bytes"] = _metric(base, "staticlm_kv_bytes")
        note = (f"{r['complete']}/{c} complete with {max_tokens} tokens" + (f", {len(r['errors'])} lost"
                                                                              if r["errors"] else "")
                + (f"; {r['tok_s'] / raw[clients[0]]['tok_s']:.2f}x one client" if c != clients[0] else "")
                + f"; load {r['load_avg'][0]:.1f}")
        file_bytes, file_name = model_file_bytes(ctx)
        budget = budget_note(peak=r["peak_pss_bytes"], file_bytes=file_bytes, kv_bytes=int(r["kv_bytes"]),
                             file_name=file_name)
        rows += [Row(f"serve.c{c}.pss", f"serve, {c} clients: server peak PSS", "MB", r["peak_pss_bytes"] / 1e6,
                     higher_is_better=False, note=budget + f"; peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB"
                     + mappings_note(memory.peak_mappings))] if PeakMemory.available() else []
        ratio = r["ttft_p95_s"] / prefill["ttft_p50_s"]
        rows += [Row(f"serve.c{c}.tok_s", f"serve, {c} clients ({r['long_clients']} long): aggregate tok/s",
                     "tok/s", r["tok_s"], note=note),
                 Row(f"serve.c{c}.ttft_p95", f"serve, {c} clients: TTFT p95", "ms", 1000 * r["ttft_p95_s"],
                     higher_is_better=False,
                     note=f"p50 {1000 * r['ttft_p50_s']:.0f} ms; {ratio:.2f}x the long prefill's p50"
                     + (f" (target <= {TTFT_TARGET:g}x)" if c == max(clients) else "")),
                 Row(f"serve.c{c}.token_p50", f"serve, {c} clients: per-token latency p50", "ms",
                     1000 * r["token_p50_s"], higher_is_better=False, note=f"p95 {1000 * r['token_p95_s']:.1f} ms")]
    ctx.extra["serve"] = {"long_prefill": prefill} | {
        str(c): {k: v for k, v in r.items() if k != "errors"} | {"errors": r["errors"][:3]} for c, r in raw.items()}
    return rows


def _conversation_rows(ctx: BenchContext, cache_on: list[dict], cache_off: list[dict]) -> list[Row]:
    num_turns = min(len(cache_on), len(cache_off))
    if not num_turns:
        raise RuntimeError("the conversation's first turn was refused")
    on = [t["ttft_s"] * 1000 for t in cache_on[:num_turns]]
    off = [t["ttft_s"] * 1000 for t in cache_off[:num_turns]]
    ctx.figures["serve_prompt_cache_ttft"] = {"turn": list(range(1, num_turns + 1)), "cache_on_ms": on,
                                              "cache_off_ms": off, "cached_tokens": [t["cached"] for t in cache_on]}
    per_turn = " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(on, off))
    last = num_turns
    return [Row("serve.cache_on.ttft_last", f"serve, turn {last} TTFT, prompt cache on", "ms", on[-1],
                higher_is_better=False,
                note=f"{off[-1] / on[-1]:.1f}x faster than off; by turn on/off ms: {per_turn}"),
            Row("serve.cache_off.ttft_last", f"serve, turn {last} TTFT, prompt cache off", "ms", off[-1],
                higher_is_better=False, note=f"turn 1: {off[0]:.0f} ms"),
            Row("serve.cache_on.ttft_mean", "serve, mean TTFT over the turns, prompt cache on", "ms",
                float(np.mean(on)), higher_is_better=False, note=f"off: {np.mean(off):.0f} ms")]


__all__ = ["bench_serve"]
