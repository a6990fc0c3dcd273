"""The second hostile probe's cases against `staticlm serve` (loopback only), each a regression test: a negative
seed, a body trickled after an answer given before it was read (413, 404, 415, 401), client errors once answered
as 500s, lone surrogates, huge integers, five stop sequences, a FIFO in the cache directory, a client that stops
reading its stream. After each bad input the server keeps serving and /metrics counts a client error, not a
server error."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest
from conftest import THREADS
from serve_helpers import free_port, logged_server, serve_command, wait_idle

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 1
SEND_TIMEOUT_S = 1
MSG = [{"role": "user", "content": "x"}]
NUM_TRICKLERS = 148  # the probe's count


@pytest.fixture(scope="module")
def hostile(tiny_chat_family, tmp_path_factory):
    """With a key (for the 401 case), short header and send timeouts; yields (base URL, its log file)."""
    log = tmp_path_factory.mktemp("hostile") / "serve.log"
    with logged_server(tiny_chat_family, log, "--api-key", KEY, "--header-timeout", str(HEADER_TIMEOUT_S),
                       "--send-timeout", str(SEND_TIMEOUT_S), "--max-body-bytes", "100000") as base:
        yield base, log


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", headers=AUTH, timeout=10).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _errors(base: str) -> tuple[float, float]:
    m = _metrics(base)
    return m["staticlm_client_errors_total"], m["staticlm_server_errors_total"]


def _post(base: str, path: str, body, *, timeout: float = 30) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}{path}", content=raw, timeout=timeout,
                      headers={"Content-Type": "application/json", **AUTH})


def _openai_error(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"], err
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


def _anthropic_error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    return body["error"]


def _still_serving(base: str, before: tuple[float, float], *, num_client_errors: int) -> None:
    """The bad inputs were counted as client errors (none as the server's), no row is held, and a good request
    is answered."""
    assert wait_idle(base)["rows_in_use"] == 0
    client, server = _errors(base)
    assert (client - before[0], server - before[1]) == (num_client_errors, 0)
    r = _post(base, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


# -- no request can hold a row --------------------------------------------------------------------------------
def test_a_negative_seed_is_a_400_and_minus_one_means_a_random_seed(hostile):
    base, _ = hostile
    before = _errors(base)
    for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": MSG, "max_tokens": 4})):
        _openai_error(_post(base, path, {**body, "seed": -2}), "seed")
        _openai_error(_post(base, path, {**body, "seed": 2**64}), "seed")
        for _ in range(5):  # more than the rows: none of them may be held
            assert _post(base, path, {**body, "seed": -1, "temperature": 1}, timeout=20).status_code == 200
    _still_serving(base, before, num_client_errors=4)


# -- no connection is held past a deadline ---------------------------------------------------------------------
def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _early_answers(port: str) -> dict[int, bytes]:
    """Headers answered before their body is read: (status) -> the request's head."""
    def head(path: str, *, content_type: str = "application/json", key: str = KEY, length: int = 1000) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {content_type}\r\n"
                f"Authorization: Bearer {key}\r\nContent-Length: {length}\r\n\r\n").encode()

    return {413: head("/v1/chat/completions", length=10_000_000_000), 404: head("/v1/nowhere"),
            415: head("/v1/chat/completions", content_type="text/plain"), 401: head("/v1/chat/completions", key="x")}


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Trickle a body byte every 0.2 s and read: whether the server closed the connection within seconds."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"x")
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def test_an_answer_before_the_body_is_read_closes_the_connection_under_a_trickled_body(hostile):
    base, _ = hostile
    before = _errors(base)
    for status, head in _early_answers(base.rsplit(":", 1)[1]).items():
        with _connect(base) as sock:
            sock.sendall(head)
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += sock.recv(65536)
            assert answer.split()[1] == str(status).encode(), answer
            assert b"connection: close" in answer.lower(), answer
            assert _closed_within(sock, HEADER_TIMEOUT_S + 1), f"a trickled body kept the {status} connection open"
    _still_serving(base, before, num_client_errors=4)


def test_148_trickling_connections_do_not_keep_health_out(hostile):
    """The probe's lock-out: many connections trickling bodies after their early answers; /health (and a
    completion) must still get through within the header timeout plus a second."""
    base, _ = hostile
    heads = list(_early_answers(base.rsplit(":", 1)[1]).values())
    stop, socks = threading.Event(), []

    def trickle() -> None:  # bounded: NUM_TRICKLERS connections, a byte each every 0.5 s, until stop (or 30 s)
        for k in range(NUM_TRICKLERS):
            try:
                s = _connect(base)
                s.sendall(heads[k % len(heads)])
                socks.append(s)
            except OSError:
                pass
        deadline = time.monotonic() + 30
        while not stop.is_set() and time.monotonic() < deadline:
            for s in socks:
                try:
                    s.sendall(b"x")
                except OSError:
                    pass
            stop.wait(0.5)

    worker = threading.Thread(target=trickle)
    worker.start()
    worst = 0.0
    try:
        time.sleep(1)  # the connections are open and trickling
        end = time.monotonic() + 4
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                ok = httpx.get(f"{base}/health", timeout=HEADER_TIMEOUT_S + 5).status_code == 200
            except httpx.HTTPError:
                ok = False
            worst = max(worst, time.monotonic() - t0 if ok else float("inf"))
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join()
        for s in socks:
            s.close()
    print(f"{NUM_TRICKLERS} trickling connections: /health's worst latency {worst:.3f} s")
    assert worst <= HEADER_TIMEOUT_S + 1, f"/health was kept out {worst:.1f} s"


def test_a_client_that_stops_reading_its_stream_is_dropped_after_the_send_timeout(hostile):
    base, log = hostile
    port = int(base.rsplit(":", 1)[1])
    # about 1.5 MB of events (top logprobs are long), past the server's capped socket buffer and the client's
    body = json.dumps({"messages": MSG, "stream": True, "max_tokens": 480, "ignore_eos": True, "temperature": 1,
                       "logprobs": True, "top_logprobs": 20, "n": 2}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small: the server's buffers fill soon
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}"
                     f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(SEND_TIMEOUT_S + 4)  # read nothing
        assert wait_idle(base)["rows_in_use"] == 0
        received, sock_error = b"", None
        sock.settimeout(10)
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except OSError as e:
            sock_error = e
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    assert b"data: [DONE]" not in received, "the stream was never dropped"
    assert sock_error is not None or b"0\r\n\r\n" not in received[-16:]
    assert "read none of its answer" in log.read_text()


# -- no client error is a 500 ------------------------------------------------------------------------------
RESPONSES_CASES = [  # (body, the param the 400 names): each of these was a 500
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": 5}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": ["c1"], "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name"),
]


@pytest.mark.parametrize(("body", "param"), RESPONSES_CASES, ids=[p for _, p in RESPONSES_CASES])
def test_responses_bad_tools_and_items_are_400s_naming_the_field(hostile, body, param):
    base, _ = hostile
    before = _errors(base)
    _openai_error(_post(base, "/v1/responses", {"max_output_tokens": 2, **body}), param)
    _still_serving(base, before, num_client_errors=1)


def test_five_stop_sequences_are_taken_by_the_messages_api(hostile):
    base, _ = hostile
    body = {"max_tokens": 4, "messages": MSG, "stop_sequences": ["a", "b", "c", "d", "e"]}
    r = _post(base, "/v1/messages", body)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = _post(base, "/v1/chat/completions", {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]})  # OpenAI's cap
    assert _openai_error(r, "stop")
    # bounded all the same: each stop string is checked at every token on the engine's thread
    assert "64" in _anthropic_error(_post(base, "/v1/messages", {**body, "stop_sequences": ["a"] * 65}))["message"]
    assert "256" in _openai_error(_post(base, "/v1/chat/completions", {"messages": MSG, "stop": "a" * 257}),
                                  "stop")["message"]


HUGE = "1" * 5000  # past Python's 4,300-digit limit for int()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
def test_an_integer_of_5000_digits_is_a_400_even_in_an_ignored_field(hostile, path):
    base, log = hostile
    before, size = _errors(base), log.stat().st_size
    r = _post(base, path, f'{{"ignored": {HUGE}, "max_tokens": {HUGE}}}'.encode())
    if path == "/v1/messages":
        assert "JSON" in _anthropic_error(r)["message"]
    else:
        assert _openai_error(r, None)["code"] == "invalid_json"
    assert "Traceback" not in log.read_text()[size:]
    _still_serving(base, before, num_client_errors=1)


SURROGATE_CASES = [  # (path, body, the param the 400 names): the tokenizer raised TypeError on each
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi \ud800"}]}, "messages[0].content"),
    ("/v1/completions", {"prompt": "Hi \ud800"}, "prompt"),
    ("/v1/responses", {"input": "Hi \ud800"}, "input"),
    ("/v1/responses", {"input": "x", "instructions": "\udfff Hi"}, "instructions"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi \ud800"}]}, None),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi \ud800"}]}, None),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES, ids=[f"{c[0]}-{c[2]}" for c in SURROGATE_CASES])
def test_a_lone_surrogate_is_a_400(hostile, path, body, param):
    base, _ = hostile
    before = _errors(base)
    r = _post(base, path, json.dumps(body).encode())  # json.dumps writes it as the escape "\ud800"
    if path.startswith("/v1/messages"):
        assert "messages[0].content" in _anthropic_error(r)["message"]
    else:
        _openai_error(r, param)
    _still_serving(base, before, num_client_errors=1)


def test_errors_about_a_translated_request_name_the_clients_field(hostile):
    base, _ = hostile
    long_prompt = "word " * 2000  # past the tiny family's context
    assert _post(base, "/v1/completions", {"prompt": long_prompt}).json()["error"]["param"] == "prompt"
    r = _post(base, "/v1/responses", {"input": "x", "instructions": long_prompt})
    assert r.json()["error"]["param"] == "input" and r.json()["error"]["code"] == "context_length_exceeded"
    r = _post(base, "/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}],
                                      "tool_choice": {"type": "function", "name": "g"}})
    assert _openai_error(r, "tool_choice")


def test_a_cut_non_streamed_response_marks_its_message_incomplete(hostile):
    base, _ = hostile
    r = _post(base, "/v1/responses", {"input": "x", "max_output_tokens": 3, "ignore_eos": True})
    answer = r.json()
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    messages = [item for item in answer["output"] if item["type"] == "message"]
    assert messages and all(m["status"] == "incomplete" for m in messages)


# -- startup ------------------------------------------------------------------------------------------------
def test_a_fifo_in_the_cache_dir_is_skipped_and_sigterm_stops_the_server(tiny_chat_family, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    os.mkfifo(cache / "trap.slot")
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_command("--model", str(tiny_chat_family), "--port", str(port), "--device",
                                              "cpu", "--threads", str(THREADS), "--cache-dir", str(cache)),
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline, up = time.monotonic() + 60, False
        while not up and time.monotonic() < deadline and proc.poll() is None:
            try:
                up = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        assert up, f"the server did not start: {log.read_text()[-500:]}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert sum("trap.slot" in line and "not a regular file" in line for line in text.splitlines()) == 1, text
    assert "Traceback" not in text


def test_a_wrong_method_is_a_405_with_a_code(hostile):
    base, _ = hostile
    before = _errors(base)
    r = httpx.get(f"{base}/v1/chat/completions", headers=AUTH, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    _still_serving(base, before, num_client_errors=1)


def test_a_send_timeout_that_is_not_positive_is_refused_before_the_model_loads():
    for value in ("0", "-1", "nan"):
        r = subprocess.run(serve_command("--model", "nowhere", "--send-timeout", value), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and r.stderr.count("\n") == 1 and "--send-timeout" in r.stderr, r.stderr
