"""Starting `staticlm serve` for the tests: a subprocess on a free loopback port, waited for on /health."""
from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx
from conftest import THREADS

from staticlm.apps.bench.serve_process import free_port, serve_command  # noqa: F401 - the tests import them from here
from staticlm.apps.bench.serve_process import running_server as bench_server

STARTUP_S = 60


@contextmanager
def running_server(model_dir: Path, *args: str):
    """Yields the base URL (http://127.0.0.1:PORT); the server is stopped after (the bench's starter, THREADS)."""
    with bench_server(model_dir, *args, threads=THREADS, startup_s=STARTUP_S) as base:
        yield base


def reference_model(family: Path):
    """The family opened in this process, the server's tests' reference (its one-sequence Generator, its logits)."""
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions

    return Model.open(family, RunOptions(device="cpu", num_threads=THREADS))


def openai_client(base: str, *, timeout: float):
    """The official openai client on base, no retries (a test sees the first answer)."""
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout)


def health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=5).json()


def wait_idle(base: str, *, timeout: float = 5.0, until: Callable[[dict], bool] = lambda _h: True) -> dict:
    """/health once no row decodes, nothing is being admitted (a prompt prefilling holds no row yet), nothing waits
    and until(health) holds (or the last one seen at the timeout): a request the client left may not have reached
    the engine yet when the client is gone."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(base)
        idle = h["rows_in_use"] == 0 and h["admitting"] == 0 and h["waiting"] == 0
        if (idle and until(h)) or time.monotonic() > deadline:
            return h
        time.sleep(0.02)


@contextmanager
def logged_server(model_dir: Path, log: Path, *args: str):
    """Like running_server, with the server's output written to `log` (for tests of what it logs)."""
    with bench_server(model_dir, *args, threads=THREADS, startup_s=STARTUP_S, log=log) as base:
        yield base


def raw_exchange(sock, request: bytes, *, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on an open socket, its answer read by Content-Length: (status, headers, body)."""
    sock.settimeout(timeout)
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body
