"""Starting `staticlm serve` for the tests: a subprocess on a free loopback port, waited for on /health."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

STARTUP_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "staticlm.apps.cli", "serve", *args]


@contextmanager
def running_server(model_dir: Path, *args: str):
    """Yields the base URL (http://127.0.0.1:PORT); the server is stopped after."""
    port = free_port()
    cmd = serve_command("--model", str(model_dir), "--port", str(port), "--device", "cpu", "--threads", "2", *args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stdout.read()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=5).json()


def wait_idle(base: str, *, timeout: float = 5.0) -> dict:
    """/health once no row decodes and nothing waits (or the last one seen at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(base)
        if (h["rows_in_use"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.02)
