"""`POST /v1/messages` (Anthropic's Messages API) through the official anthropic client on loopback: greedy text
equal to the model's own Generator, streamed events that the client assembles into the same message, a tool_use
round trip, errors in Anthropic's shape, and x-api-key."""
from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import reference_model, running_server

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

MAX_NEW = 24
TOOL = {"name": "wx", "description": "weather", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_chat_family):
    with running_server(tiny_chat_family, "--api-key", "k3y") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="k3y", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server}/v1/models", headers={"x-api-key": "k3y"}).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def reference(tiny_chat_family):
    return reference_model(tiny_chat_family)


def _greedy_text(model, text: str, system: str | None = None) -> str:
    from staticlm.runtime.generate.text_stream import GenerationParams
    from staticlm.runtime.text.chat_template import Message

    ids = model.format.prompt_ids([Message(role="user", content=text)], system_prompt=system)
    model.generator.reset()
    return model.generate(ids, GenerationParams(max_new_tokens=MAX_NEW)).text


def test_text_streamed_and_not_equals_the_generator(client, model, reference):
    want = _greedy_text(reference, "abc abd", system="Be brief.")
    kw = dict(model=model, max_tokens=MAX_NEW, extra_body={"temperature": 0}, system="Be brief.",
              messages=[{"role": "user", "content": [{"type": "text", "text": "abc abd"}]}])
    got = client.messages.create(**kw)
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
    assert "".join(b.text for b in got.content if b.type == "text") == want
    assert got.stop_reason in ("end_turn", "max_tokens") and got.usage.output_tokens >= 1
    assert got.usage.input_tokens > 0
    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == want and final.content[0].text == want and final.stop_reason == got.stop_reason
    assert final.usage.output_tokens == got.usage.output_tokens


def test_a_tool_use_round_trip(client, model):
    jsonschema = pytest.importorskip("jsonschema")
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    got = client.messages.create(model=model, max_tokens=80, extra_body={"temperature": 0}, messages=ask, tools=[TOOL],
                                 tool_choice={"type": "tool", "name": "wx"})
    assert got.stop_reason == "tool_use"
    [use] = [b for b in got.content if b.type == "tool_use"]
    assert use.name == "wx" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, TOOL["input_schema"])
    with client.messages.stream(model=model, max_tokens=80, extra_body={"temperature": 0}, messages=ask, tools=[TOOL],
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content][-1] == "tool_use"
    assert final.content[-1].input == use.input  # the same greedy call, assembled from input_json_delta
    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in got.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "sunny"}]}]
    again = client.messages.create(model=model, max_tokens=6, messages=history, tools=[TOOL])
    assert again.usage.input_tokens > got.usage.input_tokens and again.content
    count = client.messages.count_tokens(model=model, messages=history, tools=[TOOL])
    assert count.input_tokens == again.usage.input_tokens


def test_bad_input_gets_anthropic_errors_and_the_server_keeps_serving(server, client, model):
    def post(body, key="k3y"):
        return httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": key}, timeout=30)

    ok = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    cases = [
        ({**ok, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, 400, "content[0]"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope",
                                                             "content": "x"}]}]}, 400, "toolu_nope"),
        ({**ok, "thinking": {"type": "enabled", "budget_tokens": 0}}, 400, "budget_tokens"),
        ({**ok, "thinking": {"type": "enabled", "budget_tokens": -3}}, 400, "budget_tokens"),
        ({k: v for k, v in ok.items() if k != "max_tokens"}, 400, "max_tokens"),
        ({**ok, "model": "claude-9"}, 404, "claude-9"),
    ]
    for body, status, needle in cases:
        r = post(body)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and needle in err["error"]["message"]
        assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    r = post(ok, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**ok)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**{**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert post(ok).json()["content"] is not None
    assert json.loads(post(ok).text)["type"] == "message"
