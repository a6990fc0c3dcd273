"""Tool calls read out of answers in every form the template families produce (property tests): what was
rendered comes back, whatever the arguments hold; undeclared tools and broken blocks stay text."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from staticlm.apps.serve.tool_calls import parse_tool_calls

DECLARED = ("get_weather", "search", "f")
TRICKY = st.sampled_from(["{", "}", "{}", '"', "\\", "<tool_call>", "</tool_call>", "```", "[TOOL_CALLS]", ";",
                          "[ARGS]", "\n", "é", "<|python_tag|>"])
TEXT = st.lists(st.one_of(TRICKY, st.text(max_size=6)), max_size=6).map("".join)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False,
                    allow_infinity=False, width=32), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(TEXT, inner, max_size=3)), max_leaves=12)
ARGS = st.dictionaries(TEXT, JSON, max_size=4)
CALL = st.tuples(st.sampled_from(DECLARED), ARGS)
PROSE = st.text(alphabet="abc xyz.,!?\n", max_size=30)


def _hermes(calls):
    return "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def _llama3(calls):
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def _mistral(calls):
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def _mistral_v11(calls):
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def _fenced(calls):
    return "\n".join(f"```json\n{json.dumps({'name': n, 'arguments': a}, indent=2)}\n```" for n, a in calls)


FORMS = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral, "mistral_v11": _mistral_v11, "fenced": _fenced}
WITH_PROSE = ("hermes", "mistral", "mistral_v11", "fenced")  # forms that may sit inside other text


def _got(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@settings(max_examples=80, deadline=None)
@given(form=st.sampled_from(sorted(FORMS)), calls=st.lists(CALL, min_size=1, max_size=3))
def test_every_form_gives_back_its_calls_in_order(form, calls):
    content, parsed = parse_tool_calls(FORMS[form](calls), tool_names=set(DECLARED))
    assert content is None
    assert _got(parsed) == [(n, a) for n, a in calls]
    assert len({c["id"] for c in parsed}) == len(parsed) and all(c["type"] == "function" for c in parsed)


@settings(max_examples=60, deadline=None)
@given(form=st.sampled_from(WITH_PROSE), calls=st.lists(CALL, min_size=1, max_size=2), before=PROSE, after=PROSE)
def test_text_around_the_calls_stays_content(form, calls, before, after):
    text = f"{before}{FORMS[form](calls)}{after}"
    content, parsed = parse_tool_calls(text, tool_names=set(DECLARED))
    assert _got(parsed) == [(n, a) for n, a in calls]
    squeeze = lambda t: "".join((t or "").split())  # noqa: E731 -- the blank lines between blocks stay
    assert squeeze(content) == squeeze(before + after) and (content is None) == (not (before + after).strip())


@settings(max_examples=60, deadline=None)
@given(form=st.sampled_from(sorted(FORMS)), args=ARGS, name=st.sampled_from(["rm_rf", "get_weather2", "F"]))
def test_a_call_to_an_undeclared_tool_is_left_as_text(form, args, name):
    text = FORMS[form]([(name, args)])
    assert parse_tool_calls(text, tool_names=set(DECLARED)) == (text, [])


@settings(max_examples=60, deadline=None)
@given(form=st.sampled_from(sorted(FORMS)), calls=st.lists(CALL, min_size=1, max_size=2),
       cut=st.integers(1, 12))
def test_a_truncated_call_is_no_call(form, calls, cut):
    text = FORMS[form](calls)
    text = text[:max(1, len(text) - cut - (3 if form == "fenced" else 0))]
    if form == "hermes":
        text = text.removesuffix("</tool_call>"[:cut])
    _, parsed = parse_tool_calls(text, tool_names=set(DECLARED))
    # whatever was cut off is not a call; the calls before it still are
    assert _got(parsed) == [(n, a) for n, a in calls][:len(parsed)] and len(parsed) < len(calls) + (
        form == "hermes")


def test_mixed_declared_and_undeclared_blocks_and_openai_shaped_objects():
    text = ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"}{\\"}"}</tool_call>')
    content, calls = parse_tool_calls(text, tool_names={"f"})
    assert content == '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert _got(calls) == [("f", {"a": "}{"})]
    wrapped = '```json\n{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}\n```'
    assert _got(parse_tool_calls(wrapped, tool_names={"f"})[1]) == [("f", {"x": 1})]
    for text in ('{"name": "f"}', '```json\n{"name": "f", "arguments": [1]}\n```', "```\nplain code\n```",
                 '{"a": 1}', "plain text", '[TOOL_CALLS]f[ARGS]"x"'):
        assert parse_tool_calls(text, tool_names={"f"}) == (text, [])
