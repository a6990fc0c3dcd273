"""`staticlm generate --logprobs N / --json-schema / --grammar`: what a server request may ask, from the CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli_errors import assert_one_line_error, staticlm

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}
RUN = ("--no-chat", "--device", "cpu", "--temperature", "0")


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_json_schema_from_a_file_and_inline_answers_valid_json(tiny_family, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for schema in (schema_file, json.dumps(SCHEMA)):
        data = _json(staticlm("generate", "--model", tiny_family, "--prompt", "a color", *RUN, "--json",
                              "--max-new-tokens", "40", "--json-schema", schema))
        jsonschema.validate(json.loads(data["text"]), SCHEMA)  # a random tiny model, held to the schema
        assert data["finish_reason"] == "eos"  # the grammar ends the answer where the object closes


def test_several_responses_take_the_schema_and_logprobs_too(tiny_family):
    jsonschema = pytest.importorskip("jsonschema")
    data = _json(staticlm("generate", "--model", tiny_family, "--prompt", "a color", "--no-chat", "--device", "cpu",
                          "--temperature", "1.5", "--seed", "5", "--json", "--max-new-tokens", "40",
                          "--num-responses", "3", "--json-schema", json.dumps(SCHEMA), "--logprobs", "1"))
    assert len(data["responses"]) == 3
    for response in data["responses"]:
        jsonschema.validate(json.loads(response["text"]), SCHEMA)
        assert len(response["logprobs"]) == len(response["token_ids"])
        assert all(len(lp["top_logprobs"]) == 1 and lp["logprob"] <= 0 for lp in response["logprobs"])


def test_grammar_holds_the_answer_to_its_language(tiny_family):
    for sampling in (("--temperature", "0"), ("--temperature", "1.5", "--seed", "3")):
        data = _json(staticlm("generate", "--model", tiny_family, "--prompt", "yes or no", *RUN, *sampling, "--json",
                              "--max-new-tokens", "20", "--grammar", 'start: ("yes" | "no" | "maybe") "."'))
        assert data["text"] in {"yes.", "no.", "maybe."} and data["finish_reason"] == "eos", data


def test_logprobs_are_the_models_log_softmax(tiny_family, tiny_hf_model):
    torch = pytest.importorskip("torch")
    data = _json(staticlm("generate", "--model", tiny_family, "--prompt", "hi there", *RUN, "--json",
                          "--ignore-eos", "--max-new-tokens", "5", "--logprobs", "3"))
    tokens, logprobs = data["token_ids"], data["logprobs"]
    assert len(logprobs) == len(tokens) == 5
    from staticlm.runtime.model import open_tokenizer

    ids = open_tokenizer(tiny_family).encode("hi there", add_special_tokens=True)
    assert len(ids) == data["prompt_tokens"]  # what the command prefilled (a fresh process: nothing cached)
    with torch.no_grad():  # the float reference on the same weights: each step's distribution
        logits = tiny_hf_model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].double()
    want = torch.log_softmax(logits, -1).numpy()  # [5, V]
    for step, (token, item) in enumerate(zip(tokens, logprobs, strict=True)):
        top = item["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["logprob"] == pytest.approx(item["logprob"])  # greedy: the chosen token is the likeliest
        np.testing.assert_allclose(item["logprob"], want[step, token], atol=2e-3)
        np.testing.assert_allclose([t["logprob"] for t in top], np.sort(want[step])[::-1][:3], atol=2e-3)


@pytest.mark.parametrize(("flags", "fragment"), [
    (("--logprobs", "21", "--json"), "--logprobs must be in 0..20"),
    (("--logprobs", "-1", "--json"), "--logprobs must be in 0..20"),
    (("--logprobs", "2"), "add --json"),
    (("--json-schema", "{not json"), "--json-schema: not JSON"),
    (("--json-schema", "missing.json"), "--json-schema: cannot read missing.json"),
    (("--json-schema", "[1, 2]"), "a schema is a JSON object"),
    (("--json-schema", '{"type": "nope"}'), "--json-schema"),
    (("--grammar", "start: ("), "--grammar"),
])
def test_bad_logprobs_and_grammars_are_one_line_errors(tiny_family, flags, fragment):
    assert_one_line_error(staticlm("generate", "--model", tiny_family, "--prompt", "hi", *RUN, *flags), fragment)
