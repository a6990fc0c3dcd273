"""The serve bench's load: 1, 4 and 8 concurrent streaming clients, every LONG_EVERY-th of them (the first
included) sending a ~1,000-token document, the others a short question; and, as its yardstick, TTFT of that
document's prefill for one client alone.

Every long prompt starts at a word of the shipped text no other request of the run starts at, so no prompt
cache serves it (the chat template's own prefix aside). A run's figures: TTFT p50/p95 over its clients (and over
its long ones), per-token latency, aggregate tok/s (every client's tokens over the wall time from the first
request to the last token), and the load average the machine had meanwhile.
"""
from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np

from .serve_process import stream_chat

CLIENTS = (1, 4, 8)
NUM_TOKENS = 64
LONG_EVERY = 4  # clients 0, 4, ... send the long prompt
LONG_WORDS = 850  # ~1,000 SmolLM2 tokens of the shipped text with the chat template
LONG_TOKENS = 1000  # what the long prompt is fitted to on another model's tokenizer (fitted_long_words)
SHORT_WORDS = 25
NUM_PREFILL_RUNS = 3  # the one-client yardstick's TTFT samples
TTFT_TARGET = 2.0  # issue 35: TTFT p95 of the most clients within this many times the long prefill's p50


def passages(num: int, *, num_words: int = SHORT_WORDS) -> list[str]:
    """num different passages of the shipped English text."""
    from staticlm.apps.commands.eval_metrics import held_out_text

    words = held_out_text().split()
    return [" ".join(words[40 * i:40 * i + num_words]) for i in range(num)]


class Prompts:
    """Prompts of the shipped text: short ones in turn, and long ones each starting at a new word."""

    def __init__(self, *, long_words: int = LONG_WORDS, num_short: int = max(CLIENTS)) -> None:
        from staticlm.apps.commands.eval_metrics import held_out_text

        self.words, self.long_words = held_out_text().split(), long_words
        self.short = passages(num_short)
        self._starts = itertools.count(0, 53)  # 53 words apart: distinct first tokens, wrapping around the text

    def long(self) -> str:
        start = next(self._starts) % len(self.words)
        words = (self.words[start:] + self.words[:start]) * 2
        return " ".join(words[:self.long_words]) + "\n\nSummarize this text."


def fitted_long_words(count_tokens, *, target_tokens: int = LONG_TOKENS) -> int:
    """Words of the shipped text whose long prompt is about target_tokens of this model's tokens (count_tokens: text
    -> tokens): a synthetic GGUF's vocabulary splits the words far finer than SmolLM2's, past its context."""
    sample = Prompts().long()
    return max(SHORT_WORDS, round(LONG_WORDS * target_tokens / max(1, count_tokens(sample))))


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def run_clients(base: str, num_clients: int, *, max_tokens: int, prompts: Prompts, long_every: int = LONG_EVERY
                ) -> dict:
    """num_clients streaming chat completions at once; every long_every-th a long prompt (0: none)."""
    texts = [prompts.long() if long_every and i % long_every == 0 else prompts.short[i % len(prompts.short)]
             for i in range(num_clients)]
    results: list[dict | None] = [None] * num_clients
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            results[i] = stream_chat(base, [{"role": "user", "content": texts[i]}], max_tokens=max_tokens,
                                     temperature=0.8)
        except Exception as e:  # noqa: BLE001 -- a lost request is counted, not fatal
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_clients)]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    long = [r for i, r in enumerate(results) if r is not None and long_every and i % long_every == 0]
    ttft = [r["ttft_s"] for r in done]
    gaps = [g for r in done for g in r["gaps_s"]]
    return {"clients": num_clients, "long_clients": len(long), "wall_s": wall,
            "tokens": sum(r["tokens"] for r in done), "tok_s": sum(r["tokens"] for r in done) / wall,
            "complete": sum(r["tokens"] == max_tokens for r in done), "errors": errors,
            "prompt_tokens": [r["prompt_tokens"] for r in done], "cached_tokens": [r["cached"] for r in done],
            "ttft_s": ttft, "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "long_ttft_p50_s": percentile([r["ttft_s"] for r in long], 50),
            "token_p50_s": percentile(gaps, 50), "token_p95_s": percentile(gaps, 95),
            "load_avg": [*load_before, *os.getloadavg()]}  # 1/5/15-minute averages before, then after


def long_prefill(base: str, *, prompts: Prompts, num_runs: int = NUM_PREFILL_RUNS) -> dict:
    """TTFT of a long prompt for one client alone, num_runs times (each prompt new to the cache)."""
    runs = [stream_chat(base, [{"role": "user", "content": prompts.long()}], max_tokens=2) for _ in range(num_runs)]
    ttft = [r["ttft_s"] for r in runs]
    return {"ttft_s": ttft, "ttft_p50_s": percentile(ttft, 50), "prompt_tokens": [r["prompt_tokens"] for r in runs],
            "cached_tokens": [r["cached"] for r in runs], "load_avg": list(os.getloadavg())}


__all__ = ["CLIENTS", "NUM_TOKENS", "TTFT_TARGET", "Prompts", "long_prefill", "passages", "run_clients"]
