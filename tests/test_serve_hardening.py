"""What a hostile client on this machine tries against `staticlm serve` (loopback only): foreign Host names and
browser Origins, wrong content types, deep JSON, bodies cut off or never finished, stalled headers, too many
connections, a huge prompt while others wait; and request fields that used to be accepted silently."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from serve_helpers import logged_server, raw_exchange, running_server, wait_idle

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

HEADER_TIMEOUT_S = 1
BODY_TIMEOUT_S = 1
MAX_CONNECTIONS = 8
CHAT = "/v1/chat/completions"
MSG = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def hardened(tiny_chat_family, tmp_path_factory):
    """Keyless, the default body cap, short timeouts, few connections; yields (base URL, its log file)."""
    log = tmp_path_factory.mktemp("hardened") / "serve.log"
    with logged_server(tiny_chat_family, log, "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout",
                       str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)) as base:
        yield base, log


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _request(path: str, body: bytes, *, host: str = "127.0.0.1", extra: str = "",
             content_type: str = "application/json", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\nContent-Length: {n}\r\n"
            f"{extra}\r\n").encode() + body


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert code is None or err["code"] == code, err
    return err


def _post(base: str, body, **headers: str) -> httpx.Response:
    return httpx.post(f"{base}{CHAT}", content=json.dumps(body), timeout=30,
                      headers={"Content-Type": "application/json", **headers})


# -- who may call, from where, with what ----------------------------------------------------------------
def test_without_a_key_only_loopback_host_names_are_answered(hardened):
    base, _ = hardened
    port = base.rsplit(":", 1)[1]
    for host in ("attacker.test", f"attacker.test:{port}", "192.168.1.5", "127.0.0.1.attacker.test"):
        _error(_post(base, MSG, Host=host), 403, "invalid_host")
        _error(httpx.get(f"{base}/v1/models", headers={"Host": host}), 403, "invalid_host")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "127.0.0.2"):
        assert _post(base, MSG, Host=host).status_code == 200, host


def test_a_browser_origin_not_allowed_is_refused_before_anything_runs(hardened):
    base, _ = hardened
    before = _metrics(base)["staticlm_completion_tokens_total"]
    _error(_post(base, MSG, Origin="http://evil.example"), 403, "origin_not_allowed")
    # the cross-site form a page can send without a preflight: text/plain
    r = httpx.post(f"{base}{CHAT}", content=json.dumps(MSG), headers={"Content-Type": "text/plain"}, timeout=30)
    assert _error(r, 415, "unsupported_media_type")["param"] == "content-type"
    _error(httpx.post(f"{base}{CHAT}", data={"a": "b"}, timeout=30), 415)  # a form post
    assert _metrics(base)["staticlm_completion_tokens_total"] == before  # no generation ran
    assert _post(base, MSG).status_code == 200  # no Origin (not a browser): answered
    assert _post(base, MSG, **{"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_deep_json_is_a_400_and_the_keep_alive_connection_goes_on(hardened):
    base, _ = hardened
    deep = b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    deeper = b"[" * 30_000 + b"]" * 30_000  # under the body cap
    with _connect(base) as sock:
        for body in (deep, deeper):
            status, _, answer = raw_exchange(sock, _request(CHAT, body))
            assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_json"
        status, _, answer = raw_exchange(sock, _request(CHAT, json.dumps(MSG).encode()))  # same connection
        assert status == 200 and json.loads(answer)["choices"]


def test_a_client_gone_mid_body_is_a_client_abort_and_one_log_line(hardened):
    base, log = hardened
    before = _metrics(base)
    for _ in range(5):
        with _connect(base) as sock:
            sock.sendall(_request(CHAT, b'{"messages": [', length=10_000))
            time.sleep(0.05)
    deadline = time.monotonic() + 5
    while _metrics(base)["staticlm_client_aborts_total"] < before.get("staticlm_client_aborts_total", 0) + 5:
        assert time.monotonic() < deadline, "the aborts were not counted"
        time.sleep(0.05)
    after = _metrics(base)
    key499 = f'staticlm_requests_total{{endpoint="{CHAT}",status="499"}}'
    assert after[key499] - before.get(key499, 0) == 5
    assert not any("status=\"500\"" in k for k in after)
    text = log.read_text()
    assert "Traceback" not in text
    assert sum("left after" in line and "bytes of its body" in line for line in text.splitlines()) == 5


# -- stalled clients ----------------------------------------------------------------------------------------
def test_half_sent_headers_are_cut_off_at_the_header_timeout(hardened):
    base, _ = hardened
    with _connect(base) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127")
        t0 = time.monotonic()
        sock.settimeout(HEADER_TIMEOUT_S + 10)
        assert sock.recv(1024) == b""  # closed by the server, with no answer
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 5
    with _connect(base) as sock:  # a connection that sends nothing at all
        sock.settimeout(HEADER_TIMEOUT_S + 10)
        assert sock.recv(1024) == b""


def test_a_stalled_body_gets_408_at_the_body_timeout(hardened):
    base, _ = hardened
    with _connect(base) as sock:
        t0 = time.monotonic()
        status, headers, answer = raw_exchange(sock, _request(CHAT, b'{"messages": [', length=1000),
                                               timeout=BODY_TIMEOUT_S + 10)
        assert status == 408 and json.loads(answer)["error"]["code"] == "request_timeout"
        assert headers.get("connection") == "close" and time.monotonic() - t0 < BODY_TIMEOUT_S + 5


def test_connections_past_the_cap_are_closed_at_once(hardened):
    base, _ = hardened
    socks = [_connect(base) for _ in range(MAX_CONNECTIONS + 4)]
    try:
        closed = 0
        for s in socks:
            s.settimeout(0.5)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass  # still open (it would be cut at the header timeout)
        assert closed >= 4
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    assert _post(base, MSG).status_code == 200


# -- fields once accepted silently -----------------------------------------------------------------------------
def test_image_parts_and_tool_messages_without_an_id_and_too_many_choices_are_400s_naming_the_field(hardened):
    base, _ = hardened
    image = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    assert _error(_post(base, image), 400, "invalid_value")["param"] == "messages[0].content[1]"
    tool = {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "sunny"}]}
    assert _error(_post(base, tool), 400, "invalid_value")["param"] == "messages[1].tool_call_id"
    rows = httpx.get(f"{base}/health").json()["rows"]
    err = _error(_post(base, {**MSG, "n": rows + 1}), 400, "invalid_value")
    assert err["param"] == "n" and str(rows) in err["message"]
    for bad in ({"logit_bias": {"abc": 1}}, {"logit_bias": {"999999": 1}}, {"logit_bias": {"5": 101}},
                {"presence_penalty": 3}, {"frequency_penalty": -2.5}):
        assert _error(_post(base, {**MSG, **bad}), 400)["param"].startswith(next(iter(bad)))


def test_logit_bias_is_applied(hardened):
    base, _ = hardened
    body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
    first = _post(base, body).json()["choices"][0]["logprobs"]["content"][0]["token"]
    forced = "R" if first == "Q" else "Q"
    biased = _post(base, {**body, "logit_bias": {str(_token_id(forced)): 100}}).json()
    assert biased["choices"][0]["message"]["content"] == forced * 6
    banned = _post(base, {**body, "logit_bias": {str(_token_id(first)): -100}}).json()
    assert banned["choices"][0]["logprobs"]["content"][0]["token"] != first


def _token_id(text: str) -> int:
    """The tiny tokenizer's one id for a token's text."""
    from conftest import tiny_tokenizer_json
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(tiny_tokenizer_json()).encode(text).ids
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_the_default_body_cap_matches_the_context_and_413_comes_at_once(hardened):
    from staticlm.apps.serve.options import default_max_body_bytes

    base, _ = hardened
    context = httpx.get(f"{base}/v1/models").json()["data"][0]["context_length"]
    cap = default_max_body_bytes(context)
    r = _post(base, {"messages": [{"role": "user", "content": "x" * cap}]})
    assert _error(r, 413, "request_too_large") and str(cap) in r.json()["error"]["message"]
    with _connect(base) as sock:  # declared too large: answered before any of the body is sent
        status, _, _ = raw_exchange(sock, _request(CHAT, b"", length=10**9), timeout=5)
        assert status == 413


def test_traversal_in_model_or_url_is_a_404(hardened):
    base, _ = hardened
    for path in ("/v1/models/../../etc/passwd", "/v1/models/..%2F..%2Fetc%2Fpasswd", "/../../etc/passwd",
                 "/v1/%2e%2e/%2e%2e/etc/passwd"):
        assert httpx.get(f"{base}{path}").status_code == 404, path
    _error(_post(base, {**MSG, "model": "../../../etc/passwd"}), 404, "model_not_found")


# -- a huge prompt does not hold the others -------------------------------------------------------------------
def test_a_huge_prompt_is_refused_before_it_is_tokenized_while_health_keeps_answering(tiny_chat_family):
    """Three 4 MB prompts (far past the context) at once: refused by their length in characters, without the
    tokenizer, and /health answers meanwhile."""
    with running_server(tiny_chat_family, "--max-body-bytes", str(8 << 20)) as base:
        answered, results = [], []

        def big(k: int) -> None:
            t0 = time.monotonic()
            results.append((_post(base, {"messages": [{"role": "user", "content": f"word{k} " * 650_000}]}),
                            time.monotonic() - t0))

        workers = [threading.Thread(target=big, args=(k,)) for k in range(3)]
        for w in workers:
            w.start()
        with httpx.Client(timeout=30) as http:
            while any(w.is_alive() for w in workers):
                t0 = time.monotonic()
                assert http.get(f"{base}/health").status_code == 200
                answered.append(time.monotonic() - t0)
                time.sleep(0.02)
        for w in workers:
            w.join()
        for r, seconds in results:
            assert "at least" in _error(r, 400, "context_length_exceeded")["message"] and seconds < 10
        assert answered and max(answered) < 1.0, "the event loop was held while the prompts were read"
        assert wait_idle(base)["rows_in_use"] == 0
