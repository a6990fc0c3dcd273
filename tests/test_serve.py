"""`staticlm serve` through the official openai client, against a live server on 127.0.0.1 (the tiny family).

References are independent of the server: the model's one-sequence Generator opened in this process (greedy
answers, the logits behind logprobs), a JSON-schema validator, and the server's own answers with the prompt
cache off. The tiny model's sampled text is noise, so its checks compare paths, never fixed strings.
"""
from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest
from serve_helpers import free_port, health, openai_client, reference_model, running_server, serve_command, wait_idle

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

CHAT_MAX = 24


@pytest.fixture(scope="module")
def server(tiny_chat_family):
    with running_server(tiny_chat_family, "--max-queue", "4") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=30)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(tiny_chat_family):
    return reference_model(tiny_chat_family)


def greedy_reference(model, ids: list[int], max_new: int, **params):
    from staticlm.runtime.generate.text_stream import GenerationParams

    model.generator.reset()  # no prompt cache in the reference: every prefill from scratch
    return model.generate(ids, GenerationParams(max_new_tokens=max_new, **params))


def chat_ids(model, text: str, system: str | None = None) -> list[int]:
    from staticlm.runtime.text.chat_template import Message

    return model.format.prompt_ids([Message(role="user", content=text)], system_prompt=system)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


# -- answers ------------------------------------------------------------------------------------------------
def test_greedy_chat_streamed_and_not_equals_the_generator(client, model_id, reference):
    want = greedy_reference(reference, chat_ids(reference, "abc abd"), CHAT_MAX)
    messages = [{"role": "user", "content": "abc abd"}]
    got = client.chat.completions.create(model=model_id, messages=messages, max_tokens=CHAT_MAX, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == ("length" if want.finish_reason.value == "length" else "stop")
    assert got.usage.prompt_tokens == len(chat_ids(reference, "abc abd"))
    assert got.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=CHAT_MAX,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == got.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    # The second time, the whole prompt but its last token came from the prompt cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == got.usage.prompt_tokens - 1


def test_completions_greedy_and_logprobs_match_the_model(client, model_id, reference):
    prompt = "The cat sat on the"
    ids = reference.tokenizer.encode(prompt, add_special_tokens=True)
    want = greedy_reference(reference, ids, 12, ignore_eos=True)
    got = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == "length" and got.usage.completion_tokens == 12
    # Every token's logprob against the one-sequence engine's logits for the same history (teacher forcing)
    reference.generator.reset()
    logits = reference.engine.score(ids + want.token_ids[:-1])[len(ids) - 1:]  # [12, V]
    for i, (token, lp) in enumerate(zip(want.token_ids, choice.logprobs.token_logprobs)):
        expect = log_softmax(logits[i])
        assert lp == pytest.approx(expect[token], abs=2e-3)
        assert len(choice.logprobs.top_logprobs[i]) == 3 and max(choice.logprobs.top_logprobs[i].values()) == \
            pytest.approx(expect.max(), abs=2e-3)


def test_chat_logprobs_top_entries_are_sorted_and_greedy_takes_the_first(client, model_id):
    got = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=4,
                                         extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert item.token == item.top_logprobs[0].token and item.logprob == pytest.approx(tops[0])
    assert "".join(item.token for item in content) == got.choices[0].message.content


def test_n2_uses_two_rows_and_each_equals_greedy(client, model_id, reference):
    want = greedy_reference(reference, chat_ids(reference, "xyz"), 10, ignore_eos=True)
    got = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "xyz"}],
                                         max_tokens=10, temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.message.content for c in got.choices] == [want.text, want.text]
    assert got.usage.completion_tokens == 20


def test_seed_reproduces_and_stop_cuts_where_the_same_sample_reaches_it(client, model_id):
    # the whole distribution (the tiny model's mass is mostly on one token: the default top-p and min-p cut the rest)
    ask = dict(model=model_id, messages=[{"role": "user", "content": "tell"}], max_tokens=40, temperature=2.0,
               top_p=1.0, extra_body={"ignore_eos": True, "min_p": 0.0})
    texts = [client.chat.completions.create(**ask, seed=s).choices[0].message.content for s in (7, 7, 8, 9, 10)]
    assert texts[0] == texts[1] and len(texts[0]) > 10
    assert len(set(texts[1:])) > 1  # the seed matters (three other seeds, not all alike)
    full = texts[0]
    stop = next(full[i:i + 2] for i in range(len(full) // 3, len(full) - 1) if full[i:i + 2].strip())
    cut = client.chat.completions.create(**ask, seed=7, stop=[stop])
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_more_requests_than_rows_all_complete_each_as_if_alone(server, client, model_id, reference):
    prompts = [f"p{i} {'ab' * i}" for i in range(7)]  # 7 requests on 4 rows: some wait, rows are reused
    want = {p: greedy_reference(reference, chat_ids(reference, p), 16, ignore_eos=True).text for p in prompts}
    got: dict[str, str] = {}

    def ask(p: str) -> None:
        r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": p}],
                                           max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        got[p] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want
    assert wait_idle(server)["rows_in_use"] == 0


def test_a_conversation_reuses_its_cached_prefix_and_answers_as_without_it(client, model_id, reference):
    history = [{"role": "user", "content": "first question"}]
    ask = dict(model=model_id, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(messages=history, **ask)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "second"}]
    second = client.chat.completions.create(messages=history, **ask)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # the first prompt at least (and the answer's cached rows)
    from staticlm.runtime.text.chat_template import Message

    ids = reference.format.prompt_ids([Message(**m) for m in history])
    assert second.usage.prompt_tokens == len(ids)
    assert second.choices[0].message.content == greedy_reference(reference, ids, 12, ignore_eos=True).text


# -- structured output --------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "n"], "additionalProperties": False}


def test_json_schema_output_parses_and_validates(client, model_id):
    jsonschema = pytest.importorskip("jsonschema")
    for temperature, seed in ((0, None), (1.5, 3), (1.5, 4)):
        got = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "a color"}], max_tokens=60,
            temperature=temperature, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
        value = json.loads(got.choices[0].message.content)
        jsonschema.validate(value, SCHEMA)
        assert got.choices[0].finish_reason == "stop"


def test_json_object_output_is_an_object_where_it_ends(client, model_id):
    outs = [client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "json"}],
                                           max_tokens=40, temperature=t, seed=s,
                                           response_format={"type": "json_object"}).choices[0]
            for t, s in ((0, None), (1.0, 1), (1.0, 2))]
    assert all(o.message.content.startswith("{") for o in outs)
    ended = [o for o in outs if o.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(o.message.content), dict) for o in ended)


TOOLS = [{"type": "function", "function": {
    "name": "wx", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                 "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}}]


def test_a_required_tool_call_is_parsed_into_tool_calls(client, model_id):
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "Oslo?"}]
    named = {"type": "function", "function": {"name": "wx"}}
    got = client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS, tool_choice=named,
                                         max_tokens=80, temperature=0)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "wx" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    # streamed, with any of the tools
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS,
                                                 tool_choice="required", max_tokens=80, temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name in {"wx", "noop"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the call and its result go back into the conversation
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model=model_id, messages=history, tools=TOOLS[1:], max_tokens=4)
    assert again.usage.prompt_tokens > len(call.function.arguments) and again.choices[0].finish_reason != "tool_calls"


def test_tool_call_parser_reads_hermes_and_llama3_and_leaves_other_text():
    from staticlm.apps.serve.tools import parse_tool_calls

    names = {"f", "g"}
    content, calls = parse_tool_calls('ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
                                      '<tool_call>{"name": "g", "arguments": {}}</tool_call>', tool_names=names)
    assert content == "ok" and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    content, calls = parse_tool_calls('<|python_tag|>{"name": "g", "parameters": {"x": "y"}}', tool_names=names)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": "y"}
    _, calls = parse_tool_calls('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}', tool_names=names)
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    for text in ('{"name": "h", "arguments": {}}', "plain text", '<tool_call>{"name": "f"', '{"a": 1}'):
        assert parse_tool_calls(text, tool_names=names) == (text, [])


# -- errors -------------------------------------------------------------------------------------------------
def _post(base: str, path: str, body, *, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{base}{path}", content=content, timeout=30,
                      headers={"Content-Type": "application/json", **(headers or {})})


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_every_error_is_openai_shaped_and_the_server_keeps_serving(server, client, model_id):
    chat = "/v1/chat/completions"
    _error(_post(server, chat, b"{not json"), 400, "invalid_json")
    assert _error(_post(server, chat, {"model": model_id, "messages": []}), 400)["param"] == "messages"
    _error(_post(server, chat, {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404,
           "model_not_found")
    for bad in ({"temperature": -1}, {"n": 0}, {"n": 5}, {"top_p": 2}, {"max_tokens": 0}, {"stop": ["a"] * 5},
                {"messages": [{"role": "wizard", "content": "x"}]}, {"top_logprobs": 99, "logprobs": True},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
                {"tool_choice": "required"}):
        body = {"model": model_id, "messages": [{"role": "user", "content": "x"}], **bad}
        _error(_post(server, chat, body), 400)
    long_text = "word " * 600  # > 512 tokens of the byte-level tokenizer
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": long_text}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert _post(server, chat, {"model": model_id, "messages": [{"role": "user", "content": "x"}],
                                "unknown_field": {"ignored": True}, "max_tokens": 2}).status_code == 200
    _error(httpx.get(f"{server}/v1/nothing-here"), 404)
    for i in range(100):  # malformed in many ways, then a correct request
        body = [b"", b"[]", b"null", b"{", b'{"messages": "x"}', b'{"messages": [{"role": "user"}], "n": "two"}',
                "\xff".encode("latin-1")][i % 7]
        assert _post(server, chat, body).status_code == 400
    ok = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop") and wait_idle(server)["rows_in_use"] == 0


def test_max_tokens_is_capped_by_the_context(client, model_id):
    got = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}],
                                         max_tokens=100_000, temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens + got.usage.completion_tokens == 512 and got.choices[0].finish_reason == "length"


# Four rows of 450 tokens: long enough that a client gone after its first line is seen well before they end.
LONG = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 450, "n": 4, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 20}


def test_a_client_that_disconnects_mid_stream_frees_its_row(server, model_id):
    before = health(server)
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server}/v1/chat/completions",
                                                       json={**LONG, "model": model_id, "stream": True}) as r:
        assert r.status_code == 200 and next(r.iter_lines()).startswith("data: ")
    idle = wait_idle(server, timeout=5, until=lambda h: h["cancelled"] > before["cancelled"])
    assert idle["rows_in_use"] == 0 and idle["cancelled"] - before["cancelled"] == 4
    assert idle["decode_steps"] - before["decode_steps"] < 450  # it stopped before its 450 tokens
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_a_client_that_gives_up_on_a_non_streamed_answer_frees_its_row(server, model_id):
    before = health(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/chat/completions", json={**LONG, "model": model_id}, timeout=0.05)
    idle = wait_idle(server, timeout=5, until=lambda h: h["cancelled"] > before["cancelled"])
    assert idle["rows_in_use"] == 0 and idle["cancelled"] - before["cancelled"] == 4


def test_metrics_count_requests_tokens_latency_rows_and_cache_hits(server, client, model_id):
    client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "m"}], max_tokens=3)
    client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "m"}], max_tokens=3)
    text = httpx.get(f"{server}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['staticlm_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2
    assert values["staticlm_completion_tokens_total"] >= 6 and values["staticlm_prompt_tokens_total"] > 0
    assert values["staticlm_prompt_cache_hits_total"] >= 1 and values["staticlm_prompt_cached_tokens_total"] > 0
    assert values["staticlm_time_to_first_token_seconds_count"] >= 2
    assert values["staticlm_token_latency_seconds_count"] >= 1
    assert values["staticlm_kv_rows"] == 4 and values["staticlm_kv_rows_in_use"] == 0


# -- security and limits (their own servers) ---------------------------------------------------------------
KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def guarded(tiny_chat_family):
    """A key, a small body cap, sliding overflow, CORS for one origin, and no queue at all."""
    with running_server(tiny_chat_family, "--api-key", "s3cret", "--max-body-bytes", "4096", "--on-overflow", "slide",
                        "--cors", "http://app.example", "--max-queue", "0") as base:
        yield base


def test_a_key_is_required_and_checked_and_bodies_are_capped(guarded):
    base = guarded
    msg = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    _error(_post(base, "/v1/chat/completions", msg), 401, "invalid_api_key")
    _error(_post(base, "/v1/chat/completions", msg, headers={"Authorization": "Bearer wrong"}), 401)
    _error(httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer s3cretX"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
    assert good.chat.completions.create(model=good.models.list().data[0].id, **msg).choices
    huge = {"messages": [{"role": "user", "content": "x" * 10_000}]}
    _error(_post(base, "/v1/chat/completions", huge, headers=KEY), 413)
    assert httpx.get(f"{base}/health").status_code == 200  # public, no key
    # CORS on for the one origin: a preflight needs no key, the answer names the origin
    pre = httpx.options(f"{base}/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
    # --on-overflow slide: a prompt longer than the context keeps its end and is answered
    slid = good.chat.completions.create(model=good.models.list().data[0].id, max_tokens=8,
                                        messages=[{"role": "user", "content": "word " * 150 + "end?"}])
    assert slid.usage.prompt_tokens < 512 and slid.usage.completion_tokens >= 1


def test_cors_is_off_unless_asked(server):
    pre = httpx.options(f"{server}/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_past_the_queue_a_request_gets_429_with_retry_after(guarded):
    with httpx.Client(timeout=30, headers=KEY) as http, \
            http.stream("POST", f"{guarded}/v1/chat/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response, which frees the rows
        next(lines)
        late = _post(guarded, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}]}, headers=KEY)
        _error(late, 429, "queue_full")
        assert int(late.headers["Retry-After"]) >= 1
    assert wait_idle(guarded)["rows_in_use"] == 0
    assert _post(guarded, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}], "max_tokens": 2},
                 headers=KEY).status_code == 200


def test_a_non_loopback_bind_without_a_key_refuses_to_start(tiny_chat_family):
    t0 = time.monotonic()
    r = subprocess.run(serve_command("--model", str(tiny_chat_family), "--host", "0.0.0.0", "--port",
                                     str(free_port())), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--api-key" in r.stderr
    assert time.monotonic() - t0 < 30


TOOLS_TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
                  "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
                  "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]"
                  "{% endfor %}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_that_reads_tools_renders_them_and_earlier_calls(tiny_chat_family):
    from staticlm.apps.serve.prompt import chat_prompt_ids
    from staticlm.apps.serve.schemas import ChatRequest
    from staticlm.runtime.chat import ChatFormat
    from staticlm.runtime.family.manifest import load_manifest
    from staticlm.runtime.model import open_tokenizer

    tok = open_tokenizer(tiny_chat_family)
    req = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "wx", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": TOOLS})
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    # A template that reads tools gets them; one that does not (the tiny ChatML) gets them in its system message.
    chatml = load_manifest(tiny_chat_family).chat_template
    for template, marker in ((TOOLS_TEMPLATE, "<tools>wx;noop;</tools>"), (chatml, "You may call these functions")):
        fmt = ChatFormat(tokenizer=tok, chat_template=template, bos_token=None, eos_token=None)
        text = tok.decode(chat_prompt_ids(fmt, req.messages, tools=tools, system_prompt=None))
        call = text.split("Oslo?")[1].split("sunny")[0]  # the assistant's earlier call, before the tool's answer
        assert marker in text and "wx" in call and "Oslo" in call


def test_serve_takes_every_run_option_and_its_own_flags():
    from test_run_options import TYPED, argv_for

    from staticlm.apps import cli
    from staticlm.runtime.options import RunOptions

    args = cli.build_parser().parse_args(["serve", "--port", "9", "--api-key", "k", "--cors", "a", "--cors", "b",
                                          "--no-prompt-cache", "--max-queue", "3", *argv_for(TYPED)])
    assert RunOptions(**cli.typed_run_options(args)) == RunOptions(**TYPED)
    assert (args.host, args.port, args.api_key, args.cors, args.no_prompt_cache, args.max_queue) == \
        ("127.0.0.1", 9, "k", ["a", "b"], True, 3)


def test_with_a_key_401_comes_before_the_body_and_x_api_key_is_the_same_key(guarded):
    import socket

    from serve_helpers import raw_exchange

    host, port = guarded.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # a body declared, never sent
        status, _, body = raw_exchange(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                             b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n",
                                       timeout=5)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    msg = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert _post(guarded, "/v1/chat/completions", msg, headers={"x-api-key": "s3cret"}).status_code == 200
    _error(_post(guarded, "/v1/chat/completions", msg, headers={"x-api-key": "s3cre"}), 401)
    # with a key, any Host name is answered (the key is what guards a server bound beyond loopback)
    assert _post(guarded, "/v1/chat/completions", msg, headers={**KEY, "Host": "box.lan:8080"}).status_code == 200
