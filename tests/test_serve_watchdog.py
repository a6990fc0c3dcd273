"""No request can hold a row: a request that raises anywhere in the generation loop (placed on its rows,
prefilled, decoded, or in a step outside any request's own error path) fails in its API's error shape, its rows
are freed, /metrics counts a server error, and the server keeps serving. The server runs in this process (uvicorn
on a thread, loopback) so that the test can make the loop raise."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import THREADS
from serve_helpers import free_port, wait_idle

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

STARTUP_S = 60
SEND_TIMEOUT_S = 1


@pytest.fixture(scope="module")
def in_process(tiny_chat_family):
    import uvicorn

    from staticlm.apps.serve.command import build_server
    from staticlm.apps.serve.options import ServeOptions
    from staticlm.apps.serve.protocol import guarded_protocol
    from staticlm.runtime.options import RunOptions

    port = free_port()
    serve = ServeOptions(port=port, send_timeout_s=SEND_TIMEOUT_S)
    app = build_server(RunOptions(model_dir=tiny_chat_family, device="cpu", num_threads=THREADS), serve)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2,
                            http=guarded_protocol(header_timeout_s=serve.header_timeout_s,
                                                  max_connections=serve.max_connections,
                                                  send_timeout_s=serve.send_timeout_s))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.1)
    yield base
    server.should_exit = True
    thread.join(timeout=15)


def _raise_once(monkeypatch, owner, name: str, *, after: int = 0) -> list[int]:
    """owner.name raises RuntimeError on its (after + 1)-th call, once; returns [calls so far]."""
    original, calls = getattr(owner, name), [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)
    return calls


def _server_errors(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("staticlm_server_errors_total"))


def _faults():
    from staticlm.runtime.generate import admission, loop
    from staticlm.runtime.generate.generator import Generator
    from staticlm.runtime.generate.loop import GenerationLoop

    return {"placement": (admission, "new_sequences", 0),  # raised in Admissions.place: held its rows before
            "prefill": (Generator, "append_tokens", 0),
            "first_token": (loop, "choose", 0),
            "decode": (loop, "choose", 2),
            "a_step": (GenerationLoop, "_decode", 1)}  # outside every request's own error path


@pytest.mark.parametrize("fault", ["placement", "prefill", "first_token", "decode", "a_step"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_request_that_raises_in_the_loop_frees_its_rows(in_process, monkeypatch, fault, stream):
    base = in_process
    owner, name, after = _faults()[fault]
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "ignore_eos": True,
            "temperature": 1, "seed": 3, "stream": stream}
    before = _server_errors(base)
    calls = _raise_once(monkeypatch, owner, name, after=after)
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=20)
    assert calls[0] > after, f"{name} was not reached"
    if stream:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        err = events[-1]["error"]
    else:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error" and "RuntimeError" in err["message"]
    monkeypatch.undo()
    assert wait_idle(base)["rows_in_use"] == 0
    assert _server_errors(base) == before + 1
    again = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": False}, timeout=20)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8


def test_a_client_that_stops_reading_is_dropped_and_its_rows_freed_while_it_decodes(in_process, monkeypatch):
    """Decoding slowed to 25 ms a choice's token (two choices: 20 s for the answer): a client that reads none of its
    stream is dropped after the send timeout (once the socket buffers are full) and its choices are cancelled
    (not finished at their length), before they would have ended."""
    import socket

    from staticlm.runtime.generate import loop

    base = in_process
    choose = loop.choose

    def slow_choose(*args, **kwargs):
        time.sleep(0.025)
        return choose(*args, **kwargs)

    monkeypatch.setattr(loop, "choose", slow_choose)
    before = httpx.get(f"{base}/health", timeout=10).json()["cancelled"]
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 400, "n": 2,
                       "ignore_eos": True, "temperature": 1, "logprobs": True, "top_logprobs": 20}).encode()
    t0 = time.monotonic()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        health = wait_idle(base, timeout=30, until=lambda h: h["cancelled"] >= before + 2)
        seconds = time.monotonic() - t0
    assert health["cancelled"] == before + 2, f"the stalled stream was not dropped: {health}"
    assert health["rows_in_use"] == 0 and seconds < 400 * 2 * 0.025, seconds
