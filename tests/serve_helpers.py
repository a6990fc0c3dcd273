"""Starting `staticlm serve` for the tests: a subprocess on a free loopback port, waited for on /health."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from staticlm.apps.bench.serve import free_port, serve_command  # noqa: F401 - the tests import them from here
from staticlm.apps.bench.serve import running_server as bench_server

STARTUP_S = 60


@contextmanager
def running_server(model_dir: Path, *args: str):
    """Yields the base URL (http://127.0.0.1:PORT); the server is stopped after (the bench's starter, 2 threads)."""
    with bench_server(model_dir, *args, threads=2, startup_s=STARTUP_S) as base:
        yield base


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
