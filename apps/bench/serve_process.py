"""`staticlm serve` in a process of its own on a free loopback port, and one streaming client of it (the serve
bench's and the tests' starter)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

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
    first, last, gaps, text, tokens, cached, prompt = None, None, [], [], 0, 0, 0
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
                prompt = chunk["usage"]["prompt_tokens"]
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
    return {"ttft_s": first or 0.0, "gaps_s": gaps, "tokens": tokens, "cached": cached, "prompt_tokens": prompt,
            "text": "".join(text), "seconds": time.perf_counter() - t0}


__all__ = ["free_port", "running_server", "serve_command", "stream_chat"]
