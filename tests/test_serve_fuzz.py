"""Every endpoint fuzzed with schemathesis against the server's own OpenAPI document (GET /openapi.json: the request
bodies are the pydantic models the endpoints validate with), valid bodies and invalid ones: no answer is a 5xx,
every error is in its API's shape (OpenAI's with a code; Anthropic's under /v1/messages), a streamed error event
too, and no row is held afterwards. Bounded: MAX_EXAMPLES a POST endpoint, fewer for the GETs, on the tiny model,
with the server's --max-new-tokens left small (a request's max_tokens still overrides it)."""
from __future__ import annotations

import collections
import json
import time

import pytest
from serve_helpers import running_server, wait_idle

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

MAX_EXAMPLES = 30  # a POST endpoint's; the GETs take few inputs
MAX_GET_EXAMPLES = 5
ANTHROPIC = "/v1/messages"
SEEN: collections.Counter[str] = collections.Counter()
STATUSES: collections.Counter[int] = collections.Counter()
STARTED: list[float] = []


@pytest.fixture(scope="module")
def fuzzed_server(tiny_chat_family):
    with running_server(tiny_chat_family, "--max-new-tokens", "8", "--body-timeout", "5") as base:
        yield base


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    if not STARTED:
        STARTED.append(time.monotonic())
    return schemathesis.openapi.from_url(f"{fuzzed_server}/openapi.json")


def _operations() -> list[tuple[str, str]]:
    from staticlm.apps.serve.openapi import openapi_document

    return [(method.upper(), path) for path, ops in openapi_document()["paths"].items() for method in ops]


def _check_error(path: str, status: int, body) -> None:
    assert isinstance(body, dict), body
    if path.startswith(ANTHROPIC):
        assert body.get("type") == "error", body
        err = body["error"]
        assert isinstance(err.get("type"), str) and isinstance(err.get("message"), str) and err["message"], body
        assert err["type"] != "api_error", body  # Anthropic's name for a server error
        return
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert err["message"] and isinstance(err["type"], str) and isinstance(err["code"], str), body
    assert err["param"] is None or isinstance(err["param"], str), body
    assert err["type"] != "server_error", body


def _stream_errors(path: str, text: str) -> list:
    """The error events of an SSE body."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: {"):
            data = json.loads(line[6:])
            if "error" in data or data.get("type") == "error":
                out.append(data)
    return out


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize(("method", "path"), _operations(), ids=[f"{m} {p}" for m, p in _operations()])
def test_no_answer_is_a_5xx_and_every_error_is_in_its_apis_shape(api_schema, method, path, mode):
    """Valid bodies (positive) and bodies that break the schema (negative), from schemathesis's strategy."""
    from hypothesis import given

    operation = api_schema[path][method]
    if mode == "negative" and method == "GET":
        pytest.skip("a GET's only input is a path string: nothing breaks its schema")
    max_examples = MAX_EXAMPLES if method == "POST" else MAX_GET_EXAMPLES
    strategy = operation.as_strategy(generation_mode=getattr(schemathesis.GenerationMode, mode.upper()))

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case) -> None:
        SEEN[f"{method} {path}"] += 1
        response = case.call(timeout=60)
        STATUSES[response.status_code] += 1
        assert response.status_code < 500, (method, path, case.body, response.text[:500])
        _check_answer(path, response)

    fuzz()


def _check_answer(path: str, response) -> None:
    kind = response.headers.get("content-type", [""])
    kind = kind[0] if isinstance(kind, list) else kind
    if response.status_code >= 400:
        assert kind.startswith("application/json"), (path, kind)
        _check_error(path, response.status_code, response.json())
    elif kind.startswith("text/event-stream"):
        for event in _stream_errors(path, response.text):
            if path.startswith(ANTHROPIC):
                _check_error(path, 400, event)
            elif event.get("type") == "error":  # the Responses stream's error event
                assert event.get("code") and event.get("code") != "internal_error", event
            else:
                _check_error(path, 400, event)


def test_after_the_fuzzing_no_row_is_held_and_no_server_error_was_counted(fuzzed_server):
    seconds = time.monotonic() - STARTED[0] if STARTED else 0.0
    print(f"schemathesis: examples per endpoint {dict(SEEN)}; statuses {dict(STATUSES)}; {seconds:.1f} s")
    assert SEEN, "the fuzzing test did not run"
    assert len(SEEN) == len(_operations()), SEEN
    assert STARTED and all(n >= 1 for n in SEEN.values())
    assert not any(status >= 500 for status in STATUSES)
    assert wait_idle(fuzzed_server, timeout=30)["rows_in_use"] == 0
    import httpx

    metrics = httpx.get(f"{fuzzed_server}/metrics", timeout=10).text
    assert "staticlm_server_errors_total 0.0" in metrics
