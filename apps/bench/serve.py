"""`staticlm serve` under load: concurrent streaming clients, and a conversation's TTFT with the prompt cache.

The server runs in its own process (`staticlm serve` on a free loopback port, the bench's thread count); the
clients are threads here, each streaming one chat completion of a fixed number of tokens (ignore_eos, so every
request asks for the same work) with logprobs on, which tells how many tokens each SSE chunk carries.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .base import BenchContext, Row
from .memory import budget_note, model_file_bytes
from .worker import PeakMemory

CLIENTS = (1, 4, 8)
NUM_TOKENS = 64
NUM_TURNS = 10
TURN_TOKENS = 32
STARTUP_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "staticlm.apps.cli", "serve", *args]


@contextmanager
def running_server(model_dir: Path, *args: str, threads: int = 2, startup_s: float = STARTUP_S,
                   processes: list[subprocess.Popen] | None = None, log: Path | None = None):
    """`staticlm serve` in a subprocess on a free loopback port, waited for on /health; yields its base URL
    (http://127.0.0.1:PORT) and stops it after. args: more serve flags (a later flag overrides these);
    processes: receives the server's process (its memory is sampled by pid); log: where its output goes (kept
    after; default: a temporary file, read back only when the server fails to start)."""
    import httpx

    port = free_port()
    cmd = serve_command("--model", str(model_dir), "--port", str(port), "--device", "cpu", "--threads", str(threads),
                        "--max-queue", "64", *args)
    with contextlib.ExitStack() as stack:
        if log is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="staticlm-serve-"))) / "serve.log"
        with open(log, "w") as out:  # a file, not a pipe: a server that logs much never blocks on a full pipe
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if processes is not None:
            processes.append(proc)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"staticlm serve exited: {log.read_text().strip()[-500:]}")
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("staticlm serve did not start")
                time.sleep(0.1)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def stream_chat(base: str, messages: list[dict], *, max_tokens: int, temperature: float = 0.0) -> dict:
    """One streamed chat completion: TTFT, per-token gaps, token count, text."""
    import httpx

    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "logprobs": True, "top_logprobs": 0}
    t0 = time.perf_counter()
    first, last, gaps, text, tokens, cached = None, None, [], [], 0, 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk["choices"]:
                n = len((choice.get("logprobs") or {}).get("content") or [])
                if not n:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                elif last is not None:
                    gaps += [(now - last) / n] * n
                last = now
                text.append(choice["delta"].get("content") or "")
    return {"ttft_s": first or 0.0, "gaps_s": gaps, "tokens": tokens, "cached": cached, "text": "".join(text),
            "seconds": time.perf_counter() - t0}


def _load(base: str, num_clients: int, *, max_tokens: int, prompts: list[str]) -> dict:
    results: list[dict | None] = [None] * num_clients
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            results[i] = stream_chat(base, [{"role": "user", "content": prompts[i % len(prompts)]}],
                                     max_tokens=max_tokens, temperature=0.8)
        except Exception as e:  # noqa: BLE001 -- a lost request is counted, not fatal
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    ttft = [r["ttft_s"] for r in done]
    gaps = [g for r in done for g in r["gaps_s"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else 0.0
    return {"clients": num_clients, "wall_s": wall, "tokens": sum(r["tokens"] for r in done),
            "complete": sum(r["tokens"] == max_tokens for r in done), "errors": errors,
            "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
            "token_p50_s": pct(gaps, 50), "token_p95_s": pct(gaps, 95)}


def _metric(base: str, name: str) -> float:
    """One gauge from the server's /metrics (0 when it is not there)."""
    import httpx

    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _prompts(num: int, *, num_words: int = 25) -> list[str]:
    """num different passages of the shipped English text."""
    from staticlm.apps.commands.eval_metrics import held_out_text

    words = held_out_text().split()
    return [" ".join(words[40 * i:40 * i + num_words]) for i in range(num)]


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
    clients = (1, 2) if quick else CLIENTS
    max_tokens = 8 if quick else NUM_TOKENS
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    prompts = _prompts(max(clients))
    rows, raw, server = [], {}, []
    with running_server(ctx.model_dir, threads=ctx.options.threads, processes=server) as base:
        stream_chat(base, [{"role": "user", "content": "warm up"}], max_tokens=4)
        for c in clients:
            ctx.log(f"  {c} concurrent streaming client(s) x {max_tokens} tokens ...")
            with PeakMemory(server[0].pid) as memory:
                raw[c] = r = _load(base, c, max_tokens=max_tokens, prompts=prompts)
            r["peak_pss_bytes"], r["peak_rss_bytes"] = memory.peak_pss, memory.peak_rss
            r["kv_bytes"] = _metric(base, "staticlm_kv_bytes")
            tok_s = r["tokens"] / r["wall_s"]
            base_tok_s = raw[clients[0]]["tokens"] / raw[clients[0]]["wall_s"]
            note = (f"{r['complete']}/{c} complete with {max_tokens} tokens" + (f", {len(r['errors'])} lost"
                                                                                  if r["errors"] else "")
                    + (f"; {tok_s / base_tok_s:.2f}x one client" if c != clients[0] else ""))
            file_bytes, file_name = model_file_bytes(ctx)
            rows += [Row(f"serve.c{c}.pss", f"serve, {c} clients: server peak PSS", "MB", r["peak_pss_bytes"] / 1e6,
                         higher_is_better=False, note=budget_note(peak=r["peak_pss_bytes"], file_bytes=file_bytes,
                                                                  kv_bytes=int(r["kv_bytes"]), file_name=file_name)
                         + f"; peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB")] if PeakMemory.available() else []
            rows += [Row(f"serve.c{c}.tok_s", f"serve, {c} clients: aggregate tok/s", "tok/s", tok_s, note=note),
                     Row(f"serve.c{c}.ttft_p50", f"serve, {c} clients: TTFT p50", "ms", 1000 * r["ttft_p50_s"],
                         higher_is_better=False, note=f"p95 {1000 * r['ttft_p95_s']:.0f} ms"),
                     Row(f"serve.c{c}.token_p50", f"serve, {c} clients: per-token latency p50", "ms",
                         1000 * r["token_p50_s"], higher_is_better=False,
                         note=f"p95 {1000 * r['token_p95_s']:.1f} ms")]
        turns = _prompts(3, num_words=5) if quick else _prompts(NUM_TURNS)
        ctx.log(f"  a {len(turns)}-turn conversation, prompt cache on ...")
        cache_on = _conversation(base, turns, max_tokens=max_tokens if quick else TURN_TOKENS)
    with running_server(ctx.model_dir, "--no-prompt-cache", threads=ctx.options.threads) as base:
        ctx.log("  the same conversation, prompt cache off ...")
        stream_chat(base, [{"role": "user", "content": "warm up"}], max_tokens=4)
        cache_off = _conversation(base, turns, max_tokens=max_tokens if quick else TURN_TOKENS)
    num_turns = min(len(cache_on), len(cache_off))
    if not num_turns:
        raise RuntimeError("the conversation's first turn was refused")
    on = [t["ttft_s"] * 1000 for t in cache_on[:num_turns]]
    off = [t["ttft_s"] * 1000 for t in cache_off[:num_turns]]
    ctx.figures["serve_prompt_cache_ttft"] = {"turn": list(range(1, num_turns + 1)), "cache_on_ms": on,
                                              "cache_off_ms": off, "cached_tokens": [t["cached"] for t in cache_on]}
    ctx.extra["serve"] = {str(c): {k: v for k, v in r.items() if k != "errors"} | {"errors": r["errors"][:3]}
                          for c, r in raw.items()}
    per_turn = " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(on, off))
    last = num_turns
    rows += [Row("serve.cache_on.ttft_last", f"serve, turn {last} TTFT, prompt cache on", "ms", on[-1],
                 higher_is_better=False,
                 note=f"{off[-1] / on[-1]:.1f}x faster than off; by turn on/off ms: {per_turn}"),
             Row("serve.cache_off.ttft_last", f"serve, turn {last} TTFT, prompt cache off", "ms", off[-1],
                 higher_is_better=False, note=f"turn 1: {off[0]:.0f} ms"),
             Row("serve.cache_on.ttft_mean", "serve, mean TTFT over the turns, prompt cache on", "ms",
                 float(np.mean(on)), higher_is_better=False, note=f"off: {np.mean(off):.0f} ms")]
    return rows


__all__ = ["bench_serve", "stream_chat"]
