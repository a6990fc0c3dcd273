"""`POST /v1/responses` through the official openai client on loopback: greedy text equal to the model's own
Generator, streamed events that add up to the same response, a function call and its output sent back with
previous_response_id (the stored conversation, served from the prompt cache), the bounded store, and errors."""
from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import openai_client, reference_model, running_server

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

MAX_NEW = 24
TOOL = {"type": "function", "name": "wx", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_chat_family):
    with running_server(tiny_chat_family) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(tiny_chat_family):
    return reference_model(tiny_chat_family)


def test_text_streamed_and_not_equals_the_generator(client, model, reference):
    from staticlm.runtime.generate.text_stream import GenerationParams
    from staticlm.runtime.text.chat_template import Message

    ids = reference.format.prompt_ids([Message(role="user", content="abc abd")], system_prompt="Be brief.")
    reference.generator.reset()
    want = reference.generate(ids, GenerationParams(max_new_tokens=MAX_NEW)).text
    kw = dict(model=model, instructions="Be brief.", max_output_tokens=MAX_NEW, temperature=0,
              input=[{"role": "user", "content": [{"type": "input_text", "text": "abc abd"}]}])
    got = client.responses.create(**kw)
    assert got.id.startswith("resp_") and got.object == "response" and got.output_text == want
    assert got.usage.input_tokens == len(ids) and got.usage.output_tokens >= 1
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want and [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_and_its_output_continue_the_stored_conversation(client, model):
    first = client.responses.create(model=model, input="Weather in Oslo?", tools=[TOOL], max_output_tokens=80,
                                    tool_choice={"type": "function", "name": "wx"}, temperature=0)
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "wx" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    streamed = list(client.responses.create(model=model, input="Weather in Oslo?", tools=[TOOL], temperature=0,
                                            max_output_tokens=80, tool_choice="required", stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(call.arguments)
    second = client.responses.create(model=model, previous_response_id=first.id, tools=[TOOL], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the conversation's prefix came from the cache
    third = client.responses.create(model=model, previous_response_id=second.id, input="and Paris?", tools=[TOOL],
                                    max_output_tokens=2)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server, client, model):
    def post(body):
        return httpx.post(f"{server}/v1/responses", json={"model": model, **body}, timeout=30)

    cases = [({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
             ({"input": [{"type": "computer_call", "id": "c"}]}, "input[0]"),
             ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "y"}]}, "input[0].call_id"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
              "input[0].content[0]"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type")]
    for body, param in cases:
        r = post(body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and set(err) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model, input="x", previous_response_id="resp_gone")
    assert client.responses.create(model=model, input="x", max_output_tokens=2).output_text is not None


def test_the_store_keeps_the_most_recently_used_conversations():
    from staticlm.apps.serve.response_store import ResponseStore

    store = ResponseStore(max_entries=3)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}])
    assert store.get("r0") is not None  # r0 used: r1 is now the oldest
    store.put("r3", [])
    assert store.get("r1") is None and all(store.get(k) is not None for k in ("r0", "r2", "r3")) and len(store) == 3
